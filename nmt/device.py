"""Device and mixed-precision choices shared by training and decoding."""

from __future__ import annotations

import contextlib
import functools

import torch

from nmt import NMTError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise NMTError("train.device=cuda but no CUDA device is available; use cpu or auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@functools.cache
def cpu_has_bf16() -> bool:
    """Native bf16 matrix units (AVX512-BF16 / AMX) make CPU bf16 autocast worthwhile."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> the fastest safe choice: bf16 on CUDA when supported (else fp16), bf16 on CPUs
    with native bf16, fp32 otherwise. fp16 needs CUDA."""
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if cpu_has_bf16() else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise NMTError("precision fp16 needs a CUDA device; on CPU use bf16 or fp32")
    return precision


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
