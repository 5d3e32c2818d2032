"""Precision choices on the CPU (the CUDA logic: test_cuda_logic.py; a real GPU: test_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cpu_flags

from nmt import NMTError
from nmt.cpu import cpu_has_int8, cpu_has_vnni
from nmt.device import autocast, resolve_precision


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


int8_here = pytest.mark.skipif(not cpu_has_int8(), reason="torch has no fbgemm int8 kernels here")


def test_int8_is_a_decoding_precision_on_cpu():
    """int8 is for decoding on CPU: training refuses it, auto never picks it, a GPU refuses it."""
    cpu = torch.device("cpu")
    with pytest.raises(NMTError, match="unknown precision 'int8'; choose auto, fp32, bf16 or fp16"):
        resolve_precision("int8", cpu)
    assert resolve_precision("auto", cpu, decoding=True) == resolve_precision("auto", cpu)
    with pytest.raises(NMTError, match="int8 decodes on CPU only; on cuda:0 use bf16 or fp16"):
        resolve_precision("int8", torch.device("cuda:0"), decoding=True)
    if cpu_has_int8():
        assert resolve_precision("int8", cpu, decoding=True) == "int8"
    else:
        with pytest.raises(NMTError, match="needs PyTorch's fbgemm int8 kernels"):
            resolve_precision("int8", cpu, decoding=True)


@int8_here
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.ao's, for the reference
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_maps_are_torchs_dynamic_quantization(bias):
    """In int8, nmt's linear maps compute what torch's own dynamically quantized Linear
    (per-channel weights, `quantize_dynamic` with `per_channel_dynamic_qconfig`) computes, bit
    for bit, with and without a fixed_weights scope and with the fused ReLU; close to fp32 but
    not equal to it (the weights are quantized); and fp32 again outside the scope."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from nmt.models.base import fixed_weights
    from nmt.models.layers import INT8, Linear

    torch.manual_seed(0)
    layer = Linear(64, 96, bias=bias).eval()
    x = torch.randn(3, 7, 64)
    plain = torch.nn.Linear(64, 96, bias=bias)
    plain.load_state_dict(layer.state_dict())
    reference = quantize_dynamic(
        torch.nn.Sequential(plain), {torch.nn.Linear: per_channel_dynamic_qconfig}
    )
    assert "DynamicQuantizedLinear" in repr(reference)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        expected = reference(x)
        fp32 = torch.nn.functional.linear(x, layer.weight, layer.bias)
        with autocast(cpu, "int8"):
            unscoped = layer(x)
            with fixed_weights(layer):
                scoped = layer(x)
                relu = layer(x, relu=True)
                assert INT8 in layer.weight_cache
        outside = layer(x)
    assert torch.equal(unscoped, expected) and torch.equal(scoped, expected)
    assert torch.equal(relu, expected.relu())
    assert not torch.equal(expected, fp32)
    assert (expected - fp32).abs().max() < 0.02 * fp32.abs().max()
    assert torch.equal(outside, fp32)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads /proc/cpuinfo")
def test_vnni_is_what_the_cpu_lists():
    """cpu_has_vnni: 8-bit dot products (AVX512-VNNI or AMX-INT8) as the kernel lists them,
    with torch's oneDNN int8 kernel there (x86 builds have it)."""
    assert cpu_has_vnni() == bool({"avx512_vnni", "amx_int8"} & cpu_flags())


@int8_here
@pytest.mark.skipif(not cpu_has_vnni(), reason="oneDNN's u8s8 kernel runs on VNNI CPUs only")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.ao's, for the reference
@pytest.mark.parametrize("relu", [False, True])
def test_wide_int8_maps_on_onednn_compute_fbgemms_integers(relu):
    """A map WIDE times wider than its input (a vocabulary projection) over WIDE_ROWS rows or
    more runs on oneDNN (its own weight cache entry), narrower maps and fewer rows on fbgemm;
    oneDNN's results are torch's dynamic quantization's (the same int32 products) up to the
    rounding of their scaling: within 2 ulps of the largest value. On CPUs without VNNI, or
    where oneDNN's kernel is missing, every map runs on fbgemm (`cpu_has_vnni` is False)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from nmt.models.base import fixed_weights
    from nmt.models.layers import INT8, INT8_WIDE, WIDE, WIDE_ROWS, Linear

    torch.manual_seed(0)
    wide, narrow = Linear(32, 32 * WIDE).eval(), Linear(32, 32 * WIDE - 1).eval()
    x = torch.randn(WIDE_ROWS + 3, 32) * 3

    def reference(layer, x):
        plain = torch.nn.Linear(32, layer.out_features)
        plain.load_state_dict(layer.state_dict())
        quantized = quantize_dynamic(
            torch.nn.Sequential(plain), {torch.nn.Linear: per_channel_dynamic_qconfig}
        )
        y = quantized(x)
        return y.relu() if relu else y

    with torch.inference_mode(), autocast(torch.device("cpu"), "int8"):
        with fixed_weights(wide), fixed_weights(narrow):
            got = wide(x, relu=relu)
            assert set(wide.weight_cache) == {INT8_WIDE}
            few = wide(x[: WIDE_ROWS - 1], relu=relu)
            assert set(wide.weight_cache) == {INT8_WIDE, INT8}
            assert torch.equal(narrow(x, relu=relu), reference(narrow, x))
            assert set(narrow.weight_cache) == {INT8}
        unscoped = wide(x, relu=relu)  # quantized at the call, the same values
        expected, expected_few = reference(wide, x), reference(wide, x[: WIDE_ROWS - 1])
    assert torch.equal(few, expected_few) and torch.equal(unscoped, got)
    ulp = torch.finfo(torch.float32).eps * expected.abs().max()
    assert (got - expected).abs().max() <= 2 * ulp


@int8_here
def test_int8_is_per_thread_as_autocast_is():
    """A thread decoding in int8 leaves another thread's linear maps in fp32."""
    import threading

    from nmt.models.layers import Linear

    torch.manual_seed(0)
    layer = Linear(32, 32).eval()
    x = torch.randn(4, 32)
    entered, release = threading.Event(), threading.Event()

    def hold_int8():
        with autocast(torch.device("cpu"), "int8"):
            entered.set()
            release.wait(30)

    other = threading.Thread(target=hold_int8)
    other.start()
    entered.wait(30)
    try:
        with torch.inference_mode():
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    finally:
        release.set()
        other.join()
