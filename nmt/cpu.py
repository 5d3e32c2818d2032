"""What this CPU can do, as torch's oneDNN backend sees it. A leaf: imports torch only, so the
models (which must not import the process policy of `nmt.device`) can ask it too."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_bf16() -> bool:
    """Native bf16 matrix units (AVX512-BF16 / AMX) make CPU bf16 autocast worthwhile."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
