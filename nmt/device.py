"""Device and mixed-precision choices shared by training and decoding."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import sys
from collections.abc import Iterator

import torch

from nmt import NMTError
from nmt.cpu import cpu_has_bf16, cpu_has_int8
from nmt.models.layers import INT8, int8_linears  # INT8: decoding's int8 precision

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast's dtypes


DEVICE = re.compile(r"(cpu|mps|cuda)(?::([0-9]+))?")  # ASCII digits (str.isdigit takes "²")


def resolve_device(name: str) -> torch.device:
    """auto (CUDA when available), cpu, cuda, cuda:N (one of this machine's GPUs) or mps."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = DEVICE.fullmatch(name)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise NMTError(f"unknown device {name!r}; choose auto, cpu, cuda, cuda:N or mps")
    kind, index = m.group(1), m.group(2)
    available = {"cpu": True, "cuda": torch.cuda.is_available()}
    if not available.get(kind, torch.backends.mps.is_available()):
        raise NMTError(f"device {name} asked for, but this machine has none; use cpu or auto")
    if index is None:
        return torch.device(kind)
    count = torch.cuda.device_count()
    if int(index) >= count:
        raise NMTError(
            f"device {name} asked for, but this machine has {count} GPU(s): cuda:0 to "
            f"cuda:{count - 1}"
        )
    return torch.device(kind, int(index))


def cuda_has_bf16(device: torch.device) -> bool:
    """Native bf16 on this GPU: compute capability 8.0 (Ampere) or later. Not
    `torch.cuda.is_bf16_supported()`, which also says yes where bf16 is only emulated."""
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def resolve_precision(precision: str, device: torch.device, decoding: bool = False) -> str:
    """`auto` -> the fastest safe choice: bf16 on GPUs with native bf16 (else fp16 with loss
    scaling), bf16 on CPUs with native bf16, fp32 otherwise. fp16 needs CUDA. When `decoding`,
    int8 too (CPU only; never chosen by auto: it changes results, within quantization's
    error)."""
    known = ("auto", *DTYPES, INT8) if decoding else ("auto", *DTYPES)
    if precision not in known:
        raise NMTError(
            f"unknown precision {precision!r}; choose {', '.join(known[:-1])} or {known[-1]}"
        )
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if cuda_has_bf16(device) else "fp16"
        return "bf16" if cpu_has_bf16() else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise NMTError("precision fp16 needs a CUDA device; on CPU use bf16 or fp32")
    if precision == INT8 and device.type != "cpu":
        raise NMTError(f"precision int8 decodes on CPU only; on {device} use bf16 or fp16")
    if precision == INT8 and not cpu_has_int8():
        raise NMTError(
            "precision int8 needs PyTorch's fbgemm int8 kernels (an x86 CPU with AVX2), which "
            "this machine's torch does not run; use bf16 or fp32"
        )
    return precision


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The scope in which a model computes in `precision`: torch's autocast for bf16 and
    fp16, int8 linear maps (`int8_linears`, the rest in fp32) for int8, nothing for fp32."""
    if precision == INT8:
        return int8_linears()
    dtype = DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def configure_device(device: torch.device, tf32: bool = True) -> None:
    """Process settings for work on `device`: on CPU the host tuning (`configure_host`), on
    CUDA TensorFloat-32 for fp32 matmuls and convolutions when `tf32` (Ampere and later; the
    CPU's oneDNN precision is left alone). A GPU run gets none of the host tuning."""
    if device.type == "cpu":
        configure_host()
    elif device.type == "cuda":
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
            precision = "tf32" if tf32 else "ieee"
            torch.backends.cuda.matmul.fp32_precision = precision
            torch.backends.cudnn.conv.fp32_precision = precision
            torch.backends.cudnn.rnn.fp32_precision = precision
        else:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """With `enabled`, deterministic kernels for the scope (`torch.use_deterministic_algorithms`,
    cuBLAS's workspace setting, cuDNN without benchmarking), so that a resumed CUDA run is
    bit-exact on the same GPU; the process' settings are restored after it."""
    if not enabled:
        yield
        return
    # cuBLAS reads this when it creates its handle: set before the first CUDA matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


@functools.cache
def configure_host() -> None:
    """Process-wide CPU settings for training and decoding, applied once.

    - Flush denormals to zero (sped up CPU training by 10-16% in measurements).
    - glibc malloc keeps freed memory for reuse instead of returning it to the kernel: by
      default every block of 32 MB or more (the fp32 logits of one batch are ~40 MB) is a
      fresh mmap whose pages fault in again on first touch, and freed heap tops are trimmed.
      On a 2-core KVM machine that made a fp32 copy of [1340, 8000] bf16 logits take 13 ms
      instead of 1.9 ms, and the label-smoothed loss forward+backward 89 ms instead of 29 ms.
      The cost: freed memory is kept, so the heap fragments and stays at its peak. Four
      minutes of the Multi30k transformer recipe (bf16, validating every 150 steps): 3,825
      vs 3,217 tok/s, peak RSS 3.1 vs 2.5 GB.
    - The same for the arenas of other threads (decoding workers): glibc gives each thread
      heaps of at most 64 MB and unmaps a heap as soon as it is all free, which the trim
      threshold does not prevent; a beam-5 step frees its 10 MB of fp32 logits and its caches
      every time. A top pad of 64 MB keeps those heaps: beam 5 with 2 workers in fp32, 1,024
      sentences, went from ~250,000 page faults to a few hundred, and from 124.9 to 130.5
      sentences/s (medians of 6 alternating runs in one process; bf16 193.6 vs 195.6). The
      pad only reserves address space: pages count in the RSS once touched, as before.
    """
    torch.set_flush_denormal(True)
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): keep its defaults
        return
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4  # <malloc.h>
    mallopt(m_mmap_max, 0)
    mallopt(m_trim_threshold, 2**31 - 1)
    mallopt(m_top_pad, 64 << 20)
