"""Every training option README promises, observed: time budgets, the plateau schedule, the
early-stopping metrics, validation's beam, AdamW's decay, clipping, compilation, TensorBoard,
bf16 autocast, and how `nmt train` ends (non-finite losses, Ctrl-C)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_nmt, start_nmt, tiny_trainee, wait_until

from nmt import checkpoint, config
from nmt.data.prepare import prepare
from nmt.metrics import score
from nmt.run import RunDir, attach
from nmt.train import train, train_step
from nmt.translate import load_model, translate_texts

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny"
CPU = torch.device("cpu")


def tiny(*overrides: str, arch: str = "transformer") -> config.Config:
    return config.load(TINY / f"{arch}.yaml", list(overrides))


def train_api(cfg: config.Config, run: Path, **kwargs):
    attach(prepare(cfg), cfg, run)
    return train(cfg, run, **kwargs)


def records(run: Path, kind: str) -> list[dict]:
    return [r for r in RunDir(run).metrics() if r["kind"] == kind]


# -- budgets and schedules ------------------------------------------------------------------


def test_a_time_budget_ends_training(tmp_path):
    cfg = tiny("train.max_steps=100000", "train.max_minutes=0.002", "train.valid_bleu=false")
    result = train_api(cfg, tmp_path / "run")
    assert result.stop_reason == "reached train.max_minutes=0.002"
    assert result.progress.finished == result.stop_reason
    assert 1 <= result.progress.step < 100000 and result.progress.seconds >= 0.12
    assert RunDir(tmp_path / "run").state(cfg.train).kind == "finished"


NO_PROGRESS = (  # a learning rate too small to change any translation: BLEU stays put
    "train.lr=1e-12",
    "train.schedule=constant",
    "train.warmup_steps=0",
    "train.precision=fp32",
    "train.valid_max_sentences=10",
)


def test_plateau_schedule_cuts_the_learning_rate(tmp_path):
    cfg = tiny(
        *NO_PROGRESS,
        "train.schedule=plateau",
        "train.plateau_patience=1",
        "train.plateau_factor=0.5",
        "train.valid_every=2",
        "train.log_every=2",
        "train.max_steps=10",
    )
    result = train_api(cfg, tmp_path / "run")
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "run", "train")}
    # Validations at 2 (best), 4, 6 (two without improvement > patience 1: halve), 8, 10.
    assert [lrs[s] / 1e-12 for s in (2, 4, 6, 8, 10)] == pytest.approx([1, 1, 1, 0.5, 0.5])
    assert result.progress.plateau_scale == pytest.approx(0.25)  # cut again at step 10


def test_resume_after_early_stopping_with_a_larger_patience(tmp_path):
    run = tmp_path / "run"
    sets = (*NO_PROGRESS, "train.valid_every=5", "train.max_steps=100")
    first = train_api(tiny(*sets, "train.patience=2"), run)
    assert first.stop_reason == "early stopping: no improvement in 2 validations"
    assert (
        first.progress.step == 15
        and RunDir(run).state(tiny(*sets, "train.patience=2").train).kind == "finished"
    )
    more = train(tiny(*sets, "train.patience=4"), run, resume=True)
    assert more.stop_reason == "early stopping: no improvement in 4 validations"
    assert more.progress.step == 25 and more.trained_steps == 10


@pytest.mark.parametrize("metric", ["chrf", "loss"])
def test_the_early_stopping_metric_picks_the_best_validation(metric, tmp_path):
    cfg = tiny(
        f"train.early_stop_metric={metric}",
        "train.valid_every=5",
        "train.max_steps=25",
        "train.valid_max_sentences=20",
        "train.precision=fp32",
    )
    result = train_api(cfg, tmp_path / "run")
    history = result.progress.history
    best = None
    for record in history:  # running best of the chosen metric, by hand
        improves = best is None or (
            record[metric] < best if metric == "loss" else record[metric] > best
        )
        assert record["best"] is improves, (metric, record)
        best = record[metric] if improves else best
    chosen = max(history, key=lambda r: -r[metric] if metric == "loss" else r[metric])
    assert result.progress.best_step == chosen["step"]
    assert (
        checkpoint.load(tmp_path / "run" / "checkpoints" / "best.pt")["progress"]["step"]
        == (chosen["step"])
    )


def test_validation_decodes_with_its_own_beam(tmp_path):
    cfg = tiny(
        "train.valid_beam=3",
        "train.valid_every=20",
        "train.max_steps=20",
        "train.valid_max_sentences=100",
        "train.precision=fp32",
        "decode.precision=fp32",
    )
    result = train_api(cfg, tmp_path / "run")
    recorded = result.progress.history[-1]["bleu"]
    loaded = load_model(tmp_path / "run" / "checkpoints" / "last.pt", CPU)
    valid = prepare(cfg).split("valid")
    refs = [valid.texts("tgt")[:100]]

    def bleu(beam: int) -> float:
        hyps = translate_texts(
            loaded.model, loaded.tokenizer, valid.texts("src")[:100], cfg.decode, CPU, "fp32", beam
        )
        return score(hyps, refs, "de")["bleu"]["score"]

    beam3, beam1 = bleu(3), bleu(1)
    assert beam3 != beam1  # the beam matters for this model: the test can tell them apart
    assert recorded == pytest.approx(beam3, abs=1e-9)


# -- the optimizer step ---------------------------------------------------------------------


def test_adamw_decays_matrices_only(tmp_path):
    """One step from the same weights on the same batch: AdamW's weights are Adam's minus
    lr * decay * w for matrices, and equal to Adam's for biases and norms."""
    lr, wd = 0.01, 0.1
    adam_t = config.TrainConfig(max_steps=1, lr=lr, optimizer="adam")
    adamw_t = config.TrainConfig(max_steps=1, lr=lr, optimizer="adamw", weight_decay=wd)
    adam, batches = tiny_trainee(adam_t, batches=2)[:2]
    adamw, _ = tiny_trainee(adamw_t, batches=2)[:2]
    assert isinstance(adamw.optimizer, torch.optim.AdamW)
    start = {k: v.clone() for k, v in adam.model.state_dict().items()}
    train_step(adam, batches[:1], batches[0].tgt_tokens, adam_t)
    train_step(adamw, batches[:1], batches[0].tgt_tokens, adamw_t)
    a, w = adam.model.state_dict(), adamw.model.state_dict()
    for key, p0 in start.items():
        if not p0.is_floating_point():
            continue
        expected = a[key] - lr * wd * p0 if p0.dim() > 1 else a[key]
        assert torch.allclose(w[key], expected, atol=1e-7), key


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_gradients_are_clipped_before_the_update(clip):
    t = config.TrainConfig(max_steps=1, clip_norm=clip)
    trainee, batches = tiny_trainee(t, batches=2)[:2]
    seen = []

    def at_step(optimizer, args, kwargs) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    trainee.optimizer.register_step_pre_hook(at_step)
    result = train_step(trainee, batches[:1], batches[0].tgt_tokens, t)
    assert float(result.grad_norm) > 0.05  # the gradient before clipping
    if clip:
        assert seen[0] == pytest.approx(clip, rel=1e-4)
    else:  # 0: clipping off
        assert seen[0] == pytest.approx(float(result.grad_norm), rel=1e-5)


def test_bf16_autocast_is_what_a_bf16_run_computes_in(tmp_path):
    """train.precision=bf16: activations in bf16 on fp32 weights (seen in the step), the
    precision logged at the start, and other losses than an fp32 run from the same seed."""
    t = config.TrainConfig(max_steps=1)
    trainee, batches = tiny_trainee(t, batches=2)[:2]
    trainee.precision = "bf16"
    dtypes = []
    trainee.model.output.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    train_step(trainee, batches[:1], batches[0].tgt_tokens, t)
    assert dtypes == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in trainee.model.parameters())
    sets = ("train.max_steps=3", "train.log_every=1", "train.valid_bleu=false")
    losses = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        train_api(tiny(*sets, f"train.precision={precision}"), run)
        losses[precision] = [r["loss"] for r in records(run, "train")]
        start = next(
            line for line in RunDir(run).log_file.read_text().splitlines() if "start:" in line
        )
        assert json.loads(start.split("start: ", 1)[1])["precision"] == precision
    assert losses["fp32"] != losses["bf16"] and all(np.isfinite(losses["bf16"]))


def test_compile_wraps_the_model_that_trains(tmp_path, monkeypatch):
    """train.compile=true trains the torch.compile'd model. Compiled with dynamo's eager
    backend here: the full inductor build takes minutes on this 2-core machine."""
    compiled = []
    real = torch.compile

    def compile_eagerly(model, **kwargs):
        compiled.append(model)
        return real(model, backend="eager")

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    sets = (
        "train.max_steps=3",
        "train.log_every=1",
        "train.valid_bleu=false",
        "train.precision=fp32",
    )
    result = train_api(tiny(*sets, "train.compile=true"), tmp_path / "compiled")
    assert len(compiled) == 1 and result.progress.step == 3
    plain = train_api(tiny(*sets), tmp_path / "plain")
    a = [r["loss"] for r in records(tmp_path / "compiled", "train")]
    b = [r["loss"] for r in records(tmp_path / "plain", "train")]
    assert a == pytest.approx(b, rel=1e-5) and plain.progress.step == 3


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    sets = (
        "train.max_steps=4",
        "train.log_every=2",
        "train.valid_every=4",
        "train.valid_bleu=false",
    )
    train_api(tiny(*sets, "train.tensorboard=true"), tmp_path / "run")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(RunDir(tmp_path / "run").tensorboard_dir))
    events.Reload()
    assert {"train/loss", "valid/loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]


# -- how nmt train ends ---------------------------------------------------------------------


def test_repeated_non_finite_losses_exit_1(tmp_path):
    run = tmp_path / "run"
    res = run_nmt(
        "train",
        TINY / "transformer.yaml",
        "--run-dir",
        run,
        *("--set", "train.lr=1e6", "--set", "train.warmup_steps=0"),
        *("--set", "train.schedule=constant", "--set", "train.clip_norm=0"),
        *("--set", "train.max_nonfinite=3", "--set", "train.precision=fp32"),
        *("--set", "train.max_steps=200"),
    )
    assert res.returncode == 1, res.stderr
    assert "stopped: the loss was not finite for 3 consecutive steps" in res.stderr
    # what it advises can be done: a new run (a run keeps its lr), fp32 not offered to a run
    # in fp32; the tolerance itself may change on resume
    assert "train a new run (another --run-dir) with a lower train.lr (this" in res.stderr
    last = checkpoint.load(run / "checkpoints" / "last.pt")
    assert all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())
    again = run_nmt(
        "train",
        TINY / "transformer.yaml",
        "--run-dir",
        run,
        "--resume",
        "--set",
        "train.max_nonfinite=5",
    )
    assert again.returncode == 1, again.stderr
    assert "stopped: the loss was not finite for 5 consecutive steps" in again.stderr


def test_the_progress_bar_ends_where_training_ended(tmp_path):
    """The bar moves at log records; a budget that is not a multiple of train.log_every (5
    steps, a record every 10) left it at 0% when the run had reached its budget."""
    res = run_nmt(
        "train",
        TINY / "transformer.yaml",
        "--run-dir",
        tmp_path / "run",
        "--set",
        "train.max_steps=5",
    )
    assert res.returncode == 0, res.stderr
    bar = [line for line in res.stderr.splitlines() if line.startswith("train ")]
    assert bar and " 100% " in bar[-1], res.stderr


def test_ctrl_c_checkpoints_and_says_how_to_resume(tmp_path):
    run = tmp_path / "run"
    proc = start_nmt(
        "train",
        TINY / "transformer.yaml",
        "--run-dir",
        run,
        *("--set", "train.max_steps=100000", "--set", "train.save_every=5"),
    )
    wait_until((run / "checkpoints" / "step-5.pt").is_file, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "interrupted (SIGINT)" in stderr and "--resume" in stderr
    progress = checkpoint.load(run / "checkpoints" / "last.pt")["progress"]
    assert progress["step"] >= 5 and progress["finished"] == ""
