"""Precision choices: CPU logic always, CUDA paths (fp16 loss scaling, bf16) when a GPU exists."""

from __future__ import annotations

import pytest
import torch

from nmt import NMTError, config
from nmt.data.prepare import prepare
from nmt.device import autocast, cpu_has_bf16, resolve_precision
from nmt.run import attach
from nmt.train import train
from nmt.translate import load_model, search_options, translate_lines

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_resolve_precision_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == ("bf16" if cpu_has_bf16() else "fp32")
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


def _tiny(tmp_path, *overrides):
    cfg = config.load(
        "recipes/tiny/transformer.yaml", ["train.max_steps=6", "train.valid_bleu=false", *overrides]
    )
    run = tmp_path / "run"
    attach(prepare(cfg), cfg, run)
    return cfg, run


@cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_training_and_decoding(tmp_path, precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    cfg, run = _tiny(tmp_path, "train.device=cuda", f"train.precision={precision}")
    result = train(cfg, run)
    assert result.progress.step == 6
    loaded = load_model(run, torch.device("cuda"))
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())  # master weights
    opts = search_options(cfg.decode)
    out = translate_lines(
        loaded.model,
        loaded.tokenizer,
        ["A dog runs.", ""],
        opts,
        2000,
        torch.device("cuda"),
        precision,
    )
    assert len(out) == 2 and out[1] == [] and out[0]


@cuda
def test_cuda_fp16_scaler_skips_non_finite_steps(tmp_path, monkeypatch):
    import nmt.train as trainer

    real = trainer.label_smoothed_loss
    monkeypatch.setattr(trainer, "label_smoothed_loss", lambda *a: real(*a) * float("inf"))
    cfg, run = _tiny(tmp_path, "train.device=cuda", "train.precision=fp16", "train.max_nonfinite=3")
    result = train(cfg, run)
    assert result.progress.skipped_steps >= 3
    assert result.stop_reason.startswith("stopped: the loss was not finite")


@cuda
def test_cuda_fp16_overflowing_gradients_do_not_count_as_non_finite_losses(tmp_path, monkeypatch):
    """Gradient overflow is routine while the scaler calibrates; it skips those steps itself.
    Only a non-finite loss counts towards train.max_nonfinite."""
    import nmt.train as trainer

    monkeypatch.setattr(
        trainer.torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(float("inf"))
    )
    cfg, run = _tiny(
        tmp_path,
        "train.device=cuda",
        "train.precision=fp16",
        "train.max_nonfinite=3",
        "train.max_steps=6",
    )
    result = train(cfg, run)
    assert result.stop_reason == "reached train.max_steps=6"
