"""Precision choices on the CPU (the CUDA logic: test_cuda_logic.py; a real GPU: test_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
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


KERNELS_AGAIN = """
import torch
import nmt.cpu
w = torch.randn(16, 16, dtype=torch.bfloat16)
for m in [*range(64, 1164), 64]:  # 1,100 shapes, then the first one again
    torch.nn.functional.linear(torch.randn(m, 16, dtype=torch.bfloat16), w)
"""


@pytest.mark.parametrize("preset", [None, "1024"])
def test_onednn_keeps_the_kernels_of_many_batch_shapes(preset):
    """Importing nmt sets oneDNN's primitive cache to 8,192 kernels (1,024 by default): the
    kernel of a shape seen 1,100 shapes ago is still cached (oneDNN's own verbose log says
    so). A capacity the user set is left as it is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEDNN_")}
    env.update(ONEDNN_VERBOSE="profile_create", OMP_NUM_THREADS="1")
    if preset is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = preset
    done = subprocess.run(
        [sys.executable, "-c", KERNELS_AGAIN], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    created = [line for line in done.stdout.splitlines() if ",create:cache_" in line]
    if not created:
        pytest.skip("torch does not run bf16 linear maps through oneDNN on this CPU")
    last = created[-1]
    assert ("cache_hit" in last) == (preset is None), last
