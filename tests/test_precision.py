"""Precision choices on the CPU (the CUDA logic: test_cuda_logic.py; a real GPU: test_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nmt import NMTError
from nmt.device import autocast, resolve_precision


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel lists them: an oracle independent of torch."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads /proc/cpuinfo")
def test_resolve_precision_on_cpu():
    """auto: bf16 exactly where the CPU has native bf16 units (AVX512-BF16 or AMX-BF16)."""
    cpu = torch.device("cpu")
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    assert resolve_precision("auto", cpu) == ("bf16" if native else "fp32")
    assert resolve_precision("fp32", cpu) == "fp32"
    assert resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(NMTError, match="fp16 needs a CUDA device"):
        resolve_precision("fp16", cpu)


def test_autocast_contexts_on_cpu():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    with autocast(torch.device("cpu"), "bf16"):
        assert (x @ w).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert (x @ w).dtype == torch.float32
