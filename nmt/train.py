"""`nmt train`: one trainer for every architecture.

`train(cfg, run_dir)` reads top to bottom: set up (distributed, seed, data, model, optimizer,
resume), then loop: schedule -> accumulate -> clip -> step -> log -> validate -> checkpoint,
until the first budget (steps, epochs, minutes) runs out. The learning rate is a pure function
of the step (times a reduce-on-plateau factor kept in the checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nmt import NMTError, checkpoint
from nmt.config import Config, TrainConfig, arch_of
from nmt.data.batching import Batch, EncodedSplit, TokenBatches
from nmt.data.prepare import Prepared, prepare
from nmt.device import autocast, configure_host, resolve_device, resolve_precision
from nmt.evaluate import translate_texts
from nmt.metrics import bleu_metric, score
from nmt.models.base import Vocab, count_parameters
from nmt.models.registry import build_model
from nmt.special import PAD_ID

log = logging.getLogger(__name__)


# -- pure pieces ----------------------------------------------------------------------------


def lr_at(step: int, t: TrainConfig, total_steps: int | None) -> float:
    """Learning rate for optimizer step `step` (1-based), before the plateau factor."""
    warm = t.warmup_steps
    if t.schedule == "inverse_sqrt":
        if warm and step < warm:
            return t.lr * step / warm
        return t.lr * math.sqrt(max(warm, 1) / step)
    if warm and step < warm:
        return t.lr * step / warm
    if t.schedule == "cosine":
        total = max(total_steps or warm + 1, warm + 1)
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))
    return t.lr  # constant and plateau (scaled by the plateau factor)


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """Sum over non-pad positions of (1-eps)·NLL + eps·mean_v(-log p_v). logits[B,T,V]."""
    return F.cross_entropy(
        logits.float().flatten(0, 1),
        target.flatten(),
        ignore_index=PAD_ID,
        label_smoothing=eps,
        reduction="sum",
    )


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# -- observability hooks (drawn by the CLI) -------------------------------------------------


class Reporter(Protocol):
    def start(self, info: dict[str, Any]) -> None: ...
    def log(self, record: dict[str, Any]) -> None: ...
    def validation(self, record: dict[str, Any]) -> None: ...
    def message(self, text: str) -> None: ...


class NullReporter:
    def start(self, info: dict[str, Any]) -> None:
        pass

    def log(self, record: dict[str, Any]) -> None:
        pass

    def validation(self, record: dict[str, Any]) -> None:
        pass

    def message(self, text: str) -> None:
        log.info(text)


@dataclass
class Progress:
    """Everything that moves during training; saved in every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this rank already consumed in `epoch`
    tokens: int = 0  # target tokens trained on (all ranks)
    seconds: float = 0.0  # wall clock since the start, across resumes
    train_seconds: float = 0.0  # of which in training steps (no validation or checkpointing)
    plateau_scale: float = 1.0
    plateau_bad: int = 0
    best_value: float | None = None
    best_step: int = 0
    bad_validations: int = 0
    skipped_steps: int = 0
    finished: str = ""  # why a completed run ended (budget, early stopping); empty otherwise
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Result:
    run_dir: Path
    progress: Progress
    stop_reason: str


def spent_budget(progress: Progress, t: TrainConfig) -> str:
    """Why a run cannot train further under the budgets of `t` ('' when it can)."""
    if t.max_steps is not None and progress.step >= t.max_steps:
        return f"reached train.max_steps={t.max_steps}"
    if t.max_epochs is not None and progress.epoch >= t.max_epochs:
        return f"reached train.max_epochs={t.max_epochs}"
    if t.max_minutes is not None and progress.seconds >= t.max_minutes * 60:
        return f"reached train.max_minutes={t.max_minutes}"
    stopped = progress.finished.startswith("early stopping")
    if stopped and t.patience is not None and progress.bad_validations >= t.patience:
        return progress.finished
    return ""


def nothing_to_train(run_dir: Path, spent: str) -> str:
    """What to tell a user who resumes a run whose budget (or patience) is spent."""
    key = "train.patience" if spent.startswith("early stopping") else spent.split()[1].split("=")[0]
    return f"the run in {run_dir} has {spent} already; raise {key} with --set to train further"


def preflight(cfg: Config) -> tuple[torch.device, str]:
    """The checks that need no data: device, precision, and sacreBLEU's tokenizer for the target
    language when training validates BLEU. Returns the device and the precision."""
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    if cfg.train.valid_bleu:
        bleu_metric(cfg.data.tgt)
    return device, precision


def better(metric: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value < best if metric == "loss" else value > best


# -- distributed ----------------------------------------------------------------------------


def _distributed(cuda: bool) -> tuple[int, int]:
    """(rank, world size); under torchrun, joins the process group: NCCL when training on
    CUDA, gloo on CPU (also on a machine with GPUs when train.device=cpu)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if world > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_sum(value: float, world: int, device: torch.device) -> float:
    """The sum of `value` over all ranks (on `device`: NCCL reduces CUDA tensors only)."""
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


# -- the trainer ----------------------------------------------------------------------------


class _Signals:
    """SIGINT/SIGTERM: finish the current step, checkpoint, exit cleanly."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _vocab(prepared: Prepared) -> Vocab:
    v = prepared.summary["vocab"]
    return Vocab(src_size=v["src"], tgt_size=v["tgt"], shared=v["joint"])


def _validation_loss(
    model: torch.nn.Module, split: EncodedSplit, cfg: Config, device, precision
) -> dict:
    """Mean NLL (and perplexity) per target token on a split, in fixed batches."""
    batches = TokenBatches(split.src_lens, split.tgt_lens, cfg.train.batch_tokens, 0, shuffle=False)
    nll = tokens = 0.0
    model.eval()
    with torch.no_grad(), autocast(device, precision):
        for idx in batches.epoch(0):
            b = split.collate(idx).to(device)
            logits = model(b.src, b.src_mask, b.tgt_in)
            nll += float(label_smoothed_loss(logits, b.tgt_out, 0.0))
            tokens += b.tgt_tokens
    loss = nll / max(tokens, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}


def validate(
    model, prepared: Prepared, split: EncodedSplit, cfg: Config, device, precision
) -> dict:
    record = _validation_loss(model, split, cfg, device, precision)
    if cfg.train.valid_bleu:
        n = cfg.train.valid_max_sentences or len(split)
        hyps = translate_texts(
            model,
            prepared.tokenizer(),
            split.texts("src")[:n],
            cfg.decode,
            device,
            precision,
            beam=cfg.train.valid_beam,
        )
        scores = score(hyps, [split.texts("tgt")[:n]], cfg.data.tgt)
        record.update({"bleu": scores["bleu"]["score"], "chrf": scores["chrf"]["score"]})
    return record


def check_run_dir(run_dir: Path, resume: bool) -> Path:
    """Never overwrite a run by accident; never resume from nothing. Returns last.pt's path."""
    last_path = run_dir / "checkpoints" / "last.pt"
    if run_dir.exists() and not run_dir.is_dir():
        raise NMTError(f"{run_dir} is a file, not a run directory; choose another --run-dir")
    if not resume and last_path.exists():
        raise NMTError(
            f"{run_dir} already holds a trained run; continue it with --resume or choose another --run-dir"
        )
    if resume and not last_path.exists():
        raise NMTError(f"nothing to resume: {last_path} does not exist; drop --resume to start")
    return last_path


def train(
    cfg: Config,
    run_dir: Path,
    resume: bool = False,
    reporter: Reporter | None = None,
) -> Result:
    """Train `cfg` into `run_dir` (see the module docstring)."""
    reporter = reporter or NullReporter()
    t = cfg.train
    device, _ = preflight(cfg)
    rank, world = _distributed(device.type == "cuda")
    is_main = rank == 0
    ckpt_dir = run_dir / "checkpoints"
    last_path = check_run_dir(run_dir, resume)

    # Setup: device, precision, data, model, optimizer.
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    precision = resolve_precision(t.precision, device)
    configure_host()
    seed_everything(t.seed)
    if is_main:
        prepared = prepare(cfg)
    if world > 1:
        dist.barrier()
    if not is_main:
        prepared = prepare(cfg)
    train_split, valid_split = prepared.split("train"), prepared.split("valid")
    vocab = _vocab(prepared)
    arch = arch_of(cfg.model)
    model = build_model(arch, cfg.model, vocab).to(device)
    n_params = count_parameters(model)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt_cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    optimizer = opt_cls(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=t.betas,
        eps=t.eps,
        fused=True,  # one kernel per step instead of ~10 per parameter (CPU and CUDA)
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    progress = Progress()
    if resume:
        payload = checkpoint.load(last_path)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        if payload.get("scaler"):
            scaler.load_state_dict(payload["scaler"])
        progress = Progress(**payload["progress"])
        set_rng_state(payload["rng"][min(rank, len(payload["rng"]) - 1)])
        spent = spent_budget(progress, t)
        if spent:  # nothing to do: report, touch nothing
            if is_main:
                reporter.message(nothing_to_train(run_dir, spent))
            progress.finished = progress.finished or spent
            return Result(run_dir, progress, spent)
        progress.finished = ""  # this invocation's budgets decide when the run is complete
    train_model: torch.nn.Module = model
    if t.compile:
        train_model = torch.compile(model)
    if world > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            train_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    batches = TokenBatches(
        train_split.src_lens, train_split.tgt_lens, t.batch_tokens, t.seed, True, rank, world
    )
    steps_per_epoch = math.ceil(len(batches.epoch(0)) / t.accumulate)
    total_steps = t.max_steps or (t.max_epochs * steps_per_epoch if t.max_epochs else None)

    # Logs: train.log and metrics.jsonl (rank 0 only), TensorBoard when asked and installed.
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume and is_main:
        _truncate_metrics(run_dir / "metrics.jsonl", progress.step)
    info = {
        "arch": arch,
        "params": n_params,
        "device": str(device),
        "precision": precision,
        "world": world,
        "train_pairs": len(train_split),
        "valid_pairs": len(valid_split),
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "max_minutes": t.max_minutes,
        "resumed_from": progress.step if resume else None,
        "padding": batches.padding_fraction(progress.epoch),
    }
    if is_main:
        reporter.start(info)

    def write_metrics(record: dict[str, Any]) -> None:
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if tb:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    tb.add_scalar(f"{record['kind']}/{k}", v, record["step"])

    def save(kind: str, **extra: Any) -> None:
        if not is_main:
            return
        payload = {
            **extra,
            "config": cfg.to_dict(),
            "arch": arch,
            "vocab": {
                "src_size": vocab.src_size,
                "tgt_size": vocab.tgt_size,
                "shared": vocab.shared,
            },
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else {},
            "progress": progress.__dict__,
            "rng": rngs,
            "tokenizer": sorted(f.name for f in (run_dir / "tokenizer").glob("spm*.model")),
            "prepared": str(prepared.dir),
            "run_dir": str(run_dir.resolve()),  # the tokenizer's home if the file is moved
        }
        if kind == "best":
            checkpoint.save(payload, ckpt_dir / "best.pt")
            return
        checkpoint.save(payload, last_path)
        if kind == "step" and t.keep_last > 0:
            checkpoint.save(payload, ckpt_dir / f"step-{progress.step}.pt")
            for old in checkpoint.step_checkpoints(run_dir)[: -t.keep_last]:
                old.unlink()

    def gather_rngs() -> list[dict[str, Any]]:
        if world == 1:
            return [rng_state()]
        states: list[Any] = [None] * world
        dist.all_gather_object(states, rng_state())
        return states

    def validation_record(**extra: Any) -> dict[str, Any]:
        """Validate the model's current weights, log the record, keep it in the history, and
        save best.pt when it is the best so far."""
        record = validate(model, prepared, valid_split, cfg, device, precision)
        record.update({"kind": "valid", "step": progress.step, "epoch": progress.epoch})
        record.update({"minutes": progress.seconds / 60, "tokens": progress.tokens, **extra})
        metric = t.early_stop_metric if t.valid_bleu or t.early_stop_metric == "loss" else "loss"
        record["best"] = better(metric, record[metric], progress.best_value)
        if record["best"]:
            progress.best_value, progress.best_step = record[metric], progress.step
        progress.history.append(record)
        write_metrics(record)
        reporter.validation(record)
        if file_log:
            file_log.info("validation: %s", json.dumps(record))
        if record["best"]:
            save("best", **extra)
        return record

    def run_validation() -> bool:
        """Validate, keep the best checkpoint; True when early stopping says stop."""
        stop = 0.0
        if is_main:
            improved = validation_record()["best"]
            progress.bad_validations = 0 if improved else progress.bad_validations + 1
            if t.schedule == "plateau":
                if improved:
                    progress.plateau_bad = 0
                else:
                    progress.plateau_bad += 1
                    if progress.plateau_bad > t.plateau_patience:
                        progress.plateau_scale *= t.plateau_factor
                        progress.plateau_bad = 0
            if t.patience is not None and progress.bad_validations >= t.patience:
                stop = 1.0
        model.train()
        return _all_sum(stop, world, device) > 0

    def average_last_saves() -> None:
        """Validate the average of the last `train.average_last` saves like a checkpoint of
        its own (best.pt when it beats every single one); last.pt keeps the final weights."""
        saves = {int(p.stem.split("-")[1]): p for p in checkpoint.step_checkpoints(run_dir)}
        saves[progress.step] = last_path
        steps = sorted(saves)[-t.average_last :]
        if len(steps) < 2:
            reporter.message(f"train.average_last: only {len(steps)} save(s); nothing to average")
            return
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(checkpoint.average([saves[s] for s in steps])["model"])
        validation_record(averaged=steps)
        model.load_state_dict(trained)
        save("last")  # the final weights again, with the history that now holds the average

    # The loop.
    rngs: list[dict[str, Any]] = []
    start_time = time.perf_counter() - progress.seconds
    stop_reason = ""
    nonfinite = 0
    model.train()
    log_tokens, log_loss, log_time = 0, 0.0, time.perf_counter()
    with contextlib.ExitStack() as closing, _Signals() as signals:  # closes logs, also on errors
        file_log = _file_logger(run_dir, closing) if is_main else None
        metrics = closing.enter_context(open(run_dir / "metrics.jsonl", "a")) if is_main else None
        tb = _tensorboard(run_dir) if (is_main and t.tensorboard) else None
        if tb:
            closing.callback(tb.close)
        if file_log:
            file_log.info("resolved config:\n%s", cfg.to_yaml())
            file_log.info("start: %s", json.dumps(info))
            file_log.info("data: %s", json.dumps(prepared.summary))
        while not stop_reason:
            epoch_batches = batches.epoch(progress.epoch, start=progress.batch_in_epoch)
            if not epoch_batches:  # a checkpoint saved at the very end of an epoch
                progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
                stop_reason = progress.finished = spent_budget(progress, t)
                continue
            for g in range(0, len(epoch_batches), t.accumulate):
                group = [train_split.collate(i) for i in epoch_batches[g : g + t.accumulate]]
                step_start = time.perf_counter()
                # Schedule: the LR is a pure function of the step.
                lr = lr_at(progress.step + 1, t, total_steps) * progress.plateau_scale
                for param_group in optimizer.param_groups:
                    param_group["lr"] = lr
                # Accumulate: normalise by all target tokens of the step, on every rank.
                step_tokens = _all_sum(sum(b.tgt_tokens for b in group), world, device)
                loss_sum = _accumulate(
                    train_model, group, step_tokens, world, device, precision, scaler, t
                )
                loss_sum = _all_sum(loss_sum, world, device)  # every rank sees the global loss
                # Clip and step (fp16: the scaler skips steps with inf/nan gradients).
                scaler.unscale_(optimizer)
                grad_norm = float(
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm or float("inf"))
                )
                # fp16: overflowing gradients are the scaler's business (it skips the step and
                # halves its scale) as long as there is scale left to lower; at a scale <= 1
                # they count towards train.max_nonfinite like a non-finite loss.
                scale_before = scaler.get_scale() if scaler.is_enabled() else 1.0
                finite = math.isfinite(loss_sum) and (
                    math.isfinite(grad_norm) or scale_before > 1.0
                )
                if scaler.is_enabled():
                    scaler.step(optimizer)
                    scaler.update()
                    if scaler.get_scale() < scale_before:
                        progress.skipped_steps += 1
                elif finite:
                    optimizer.step()
                else:
                    progress.skipped_steps += 1
                optimizer.zero_grad(set_to_none=True)
                nonfinite = 0 if finite else nonfinite + 1
                progress.step += 1
                progress.batch_in_epoch += len(group)
                progress.tokens += int(step_tokens)
                progress.seconds = time.perf_counter() - start_time
                progress.train_seconds += time.perf_counter() - step_start
                # Log.
                log_tokens += int(step_tokens)
                log_loss += loss_sum
                if progress.step % t.log_every == 0 and is_main:
                    now = time.perf_counter()
                    record = {
                        "kind": "train",
                        "step": progress.step,
                        "epoch": progress.epoch,
                        "loss": log_loss / max(log_tokens, 1),
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens_per_s": log_tokens / max(now - log_time, 1e-9),
                        "minutes": progress.seconds / 60,
                        "skipped": progress.skipped_steps,
                    }
                    write_metrics(record)
                    reporter.log(record)
                    log_tokens, log_loss, log_time = 0, 0.0, now
                if g + t.accumulate >= len(epoch_batches):  # the epoch's last step
                    progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
                # Stop conditions, agreed by every rank. One sum carries both flags: a signal
                # counts 1 per rank, running out of time world + 1 per rank.
                over_time = t.max_minutes is not None and progress.seconds >= t.max_minutes * 60
                flags = _all_sum(
                    float(signals.received is not None) + (world + 1.0) * float(over_time),
                    world,
                    device,
                )
                if nonfinite >= t.max_nonfinite:
                    stop_reason = (
                        f"stopped: the loss was not finite for {nonfinite} consecutive steps; "
                        "lower train.lr or use train.precision=fp32 (last.pt holds the last good weights)"
                    )
                elif t.max_steps is not None and progress.step >= t.max_steps:
                    stop_reason = f"reached train.max_steps={t.max_steps}"
                elif t.max_epochs is not None and progress.epoch >= t.max_epochs:
                    stop_reason = f"reached train.max_epochs={t.max_epochs}"
                elif flags >= world + 1:
                    stop_reason = f"reached train.max_minutes={t.max_minutes}"
                elif flags >= 1:
                    stop_reason = f"interrupted ({signals.received or 'signal on another rank'})"
                # Validate and checkpoint (RNG states as of the end of this step).
                validating = bool(stop_reason) or progress.step % t.valid_every == 0
                saving = bool(stop_reason) or progress.step % t.save_every == 0
                if validating or saving:
                    rngs = gather_rngs()
                if validating and run_validation() and not stop_reason:
                    stop_reason = f"early stopping: no improvement in {t.patience} validations"
                    saving = True
                if stop_reason.startswith(("reached", "early stopping")):
                    progress.finished = stop_reason
                if saving:
                    save("last" if stop_reason else "step")
                if progress.finished and t.average_last > 1 and is_main:
                    average_last_saves()
                if stop_reason:
                    break
                if validating or saving:  # keep tokens/s about training only
                    log_tokens, log_loss, log_time = 0, 0.0, time.perf_counter()
        if file_log:
            file_log.info("end: %s at step %d", stop_reason, progress.step)
    if world > 1:
        dist.barrier()
    return Result(run_dir, progress, stop_reason)


def _accumulate(
    model, group: list[Batch], step_tokens: float, world: int, device, precision, scaler, t
) -> float:
    """Forward/backward over the micro-batches of one step; returns the summed loss."""
    total = 0.0
    for i, batch in enumerate(group):
        batch = batch.to(device)
        last = i == len(group) - 1
        sync = contextlib.nullcontext() if (last or world == 1) else model.no_sync()
        with sync:
            with autocast(device, precision):
                logits = model(batch.src, batch.src_mask, batch.tgt_in)
            loss = label_smoothed_loss(logits, batch.tgt_out, t.label_smoothing)
            # DDP averages gradients over ranks: multiply by world to get a sum over all tokens.
            scaler.scale(loss * (world / step_tokens)).backward()
        total += float(loss.detach())
    return total


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl. A last line cut short (the run was killed while
    writing it) is left out; any other line that is not a JSON record is an error."""
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise NMTError(
                f"{path}, line {i + 1}, is not a JSON record; repair that line or delete the file "
                "(the checkpoints keep the validation history)"
            ) from None
    return records


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after the checkpoint a resumed run restarts from (a killed run may
    have logged steps it will now repeat, or half a line)."""
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")


def _file_logger(run_dir: Path, closing: contextlib.ExitStack) -> logging.Logger:
    """The run's train.log; its file is closed (and the handler removed) by `closing`."""
    logger = logging.getLogger(f"nmt.run.{run_dir.resolve()}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)

    def close() -> None:
        logger.removeHandler(handler)
        handler.close()

    closing.callback(close)
    return logger


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("train.tensorboard is on but tensorboard is not installed; skipping it")
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))
