"""What this CPU can do, as torch's oneDNN backend sees it, and how many oneDNN kernels it
keeps. A leaf: imports torch only, so the models (which must not import the process policy of
`nmt.device`) can ask it too.

oneDNN keeps the primitives it makes for a shape (a matmul's kernel for its sizes) in a cache
of ONEDNN_PRIMITIVE_CACHE_CAPACITY entries, 1,024 by default, read when it makes its first
primitive. Token-budget batches come in many shapes: an epoch of the Multi30k transformer
recipe has 208 (133 distinct matrix heights), and each needs a forward and two backward
kernels per projection size, more than 1,024 in all, so with the default the cache evicted
and remade kernels at every step. 6-minute `nmt train` of that recipe in bf16, one after the
other on 2 Zen 4 cores (scripts/bench_memory.py --minutes 6): 3,677 tok/s logged with the
default, 4,175 with 8,192, peak RSS 3.74 vs 3.68 GB. This module sets 8,192 when it is first
imported (before nmt makes any primitive), unless the variable is set already.
"""

from __future__ import annotations

import functools
import os

import torch

PRIMITIVE_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
os.environ.setdefault(PRIMITIVE_CACHE, "8192")


@functools.cache
def cpu_has_bf16() -> bool:
    """Native bf16 matrix units (AVX512-BF16 / AMX) make CPU bf16 autocast worthwhile."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def cpu_has_int8() -> bool:
    """PyTorch's quantized int8 linear maps run here (fbgemm: x86 CPUs with AVX2 or later),
    which `nmt.models.layers.int8_linears` decodes with: tried once on a tiny weight."""
    import warnings

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated (2.13)
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_tensor(torch.ones(2, 2), 0.1, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(q, None)
            torch.ops.quantized.linear_dynamic(torch.ones(1, 2), packed, True)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@functools.cache
def cpu_has_vnni() -> bool:
    """8-bit dot products without saturation (AVX512-VNNI or AMX) and oneDNN's u8s8 linear
    kernel, which `nmt.models.layers` runs wide int8 maps on: tried once on a tiny weight."""
    try:
        if not (torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()):
            return False
        packed = torch.ops.onednn.qlinear_prepack(torch.ones(2, 2, dtype=torch.int8), None)
        x = torch.ones(1, 2, dtype=torch.uint8)
        one, zero = torch.ones(2), torch.zeros(2, dtype=torch.long)
        torch.ops.onednn.qlinear_pointwise(
            x, 1.0, 0, packed, one, zero, None, 1.0, 0, torch.float32, "none", [], ""
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True
