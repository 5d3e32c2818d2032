"""`nmt train`: one trainer for every architecture.

`train(cfg, run_dir)` reads top to bottom: check, prepare, lock the run, set up (processes,
model, optimizer, resume), then loop: schedule -> step -> measure -> decide -> validate ->
checkpoint, until the first budget (steps, epochs, minutes) runs out or a signal arrives. The
learning rate is a pure function of the step (times a reduce-on-plateau factor kept in the
checkpoint). The run directory's layout, state and budget rule live in `nmt.run`; the
process group and RNG states in `nmt.distributed`.

No step waits for the device: losses, gradient norms and non-finite counts stay on it
(`StepMeter`) and are read every `read_every` steps (every step on CPU, where a read costs
nothing; every `train.log_every` steps on CUDA). Ranks agree on host flags (signals, time) in
one small gloo all-reduce per step, and on step token counts without talking
(`TokenBatches.steps`).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from nmt import NMTError, allocator, checkpoint, distributed
from nmt.config import Config, TrainConfig, arch_of
from nmt.data.batching import Batch, EncodedSplit, TokenBatches
from nmt.data.prepare import Prepared, prepare
from nmt.device import (
    autocast,
    configure_device,
    deterministic_algorithms,
    resolve_device,
    resolve_precision,
)
from nmt.distributed import World
from nmt.metrics import bleu_metric, score
from nmt.models.base import Vocab, count_parameters
from nmt.models.registry import build_model
from nmt.run import RunDir, RunLog, TrainProgress, spent_budget, step_of
from nmt.special import PAD_ID
from nmt.translate import translate_texts

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


def better(metric: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value < best if metric == "loss" else value > best


def nothing_to_train(run: RunDir, spent: str) -> str:
    """What to tell a user who resumes a run whose budget (or patience) is spent."""
    key = "train.patience" if spent.startswith("early stopping") else spent.split()[1].split("=")[0]
    return f"the run in {run} has {spent} already; raise {key} with --set to train further"


def preflight(cfg: Config) -> tuple[torch.device, str]:
    """The checks that need no data: device, precision, and sacreBLEU's tokenizer for the target
    language when training validates BLEU. Returns the device and the precision."""
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    if cfg.train.valid_bleu:
        bleu_metric(cfg.data.tgt)
    return device, precision


# -- observability hooks (drawn by the CLI) -------------------------------------------------


class Reporter(Protocol):
    def prepared(self, prepared: Prepared, padding: float) -> None: ...
    def start(self, info: dict[str, Any]) -> None: ...
    def log(self, record: dict[str, Any]) -> None: ...
    def validation(self, record: dict[str, Any]) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, progress: TrainProgress) -> None: ...


class NullReporter:
    def prepared(self, prepared: Prepared, padding: float) -> None:
        pass

    def start(self, info: dict[str, Any]) -> None:
        pass

    def log(self, record: dict[str, Any]) -> None:
        pass

    def validation(self, record: dict[str, Any]) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def finish(self, progress: TrainProgress) -> None:
        pass


class Interrupted(Exception):
    """A signal stopped training, which saved where it was: raised by what cannot go on
    without the trained run (nmt compare). `signal`: its name (SIGINT, SIGTERM)."""

    def __init__(self, signal: str) -> None:
        super().__init__(signal)
        self.signal = signal


@dataclass
class Result:
    run_dir: Path
    progress: TrainProgress
    stop_reason: str
    trained_steps: int = 0  # steps this call trained (0: the budget was spent already)
    signal: str | None = None  # the signal this process received that stopped it (SIGINT...)


# -- what is trained ------------------------------------------------------------------------


@dataclass
class Trainee:
    """The model being trained and what updates it. `model` holds the parameters
    (checkpointed, validated); `runner` is what a step calls: the model, wrapped for
    data-parallel training and compiled as configured."""

    model: torch.nn.Module
    runner: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: str
    world: World

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def build_trainee(
    cfg: Config, vocab: Vocab, device: torch.device, precision: str, world: World
) -> Trainee:
    """Model (seeded by train.seed), Adam(W) and the fp16 loss scaler; not yet wrapped."""
    distributed.seed_everything(cfg.train.seed)
    model = build_model(arch_of(cfg.model), cfg.model, vocab).to(device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    return Trainee(model, model, make_optimizer(model, cfg.train), scaler, precision, world)


def make_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """Adam or AdamW, fused; weight decay on matrices only (not on biases and norms)."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt_cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    return opt_cls(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=t.betas,
        eps=t.eps,
        fused=True,  # one kernel per step instead of ~10 per parameter (CPU and CUDA)
    )


def wrap(trainee: Trainee, compile_model: bool) -> None:
    """DistributedDataParallel for several processes, then torch.compile when asked: the
    order PyTorch documents, so that compilation sees DDP's gradient buckets and can split
    its graphs at their boundaries."""
    runner = trainee.model
    if trainee.world.size > 1:
        device = trainee.device
        runner = torch.nn.parallel.DistributedDataParallel(
            runner, device_ids=[device.index] if device.type == "cuda" else None
        )
    if compile_model:
        runner = torch.compile(runner)
    trainee.runner = runner


# -- one optimizer step ---------------------------------------------------------------------


@dataclass
class StepResult:
    """What one step measured, on the device (0-d tensors)."""

    loss: torch.Tensor  # summed label-smoothed loss of the step, all ranks (float64)
    grad_norm: torch.Tensor  # before clipping
    bad: torch.Tensor  # counts towards train.max_nonfinite (bool)
    skipped: torch.Tensor  # the optimizer left the weights as they were (bool)


def accumulate(
    model: torch.nn.Module,
    batches: list[Batch],
    step_tokens: float,
    world: World,
    precision: str,
    scaler: torch.amp.GradScaler,
    t: TrainConfig,
) -> torch.Tensor:
    """Forward/backward over the micro-batches of one step (on the device), gradients
    normalised by the target tokens of the whole step on all ranks. Returns the step's summed
    loss over all ranks (0-d float64 on the device; nothing here waits for it)."""
    device = batches[0].src.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        sync = contextlib.nullcontext() if (last or world.size == 1) else model.no_sync()
        with sync:
            with autocast(device, precision):
                logits = model(batch.src, batch.src_mask, batch.tgt_in, batch.src_lengths)
            loss = label_smoothed_loss(logits, batch.tgt_out, t.label_smoothing)
            # DDP averages gradients over ranks: multiply by world to get a sum over all tokens.
            scaler.scale(loss * (world.size / step_tokens)).backward()
        loss_sum += loss.detach()
    return distributed.device_sum_(loss_sum, world)  # every rank sees the step's loss


def update(trainee: Trainee, loss_sum: torch.Tensor, t: TrainConfig) -> StepResult:
    """Clip the accumulated gradients, step the optimizer, zero the gradients.

    A step with a non-finite loss or gradient leaves the weights as they are: without loss
    scaling the fused optimizer is told so through its `found_inf` input (the protocol
    GradScaler uses with it), with it (fp16) the scaler skips the step itself and halves its
    scale; there only a non-finite loss is `bad`, gradient overflow being the scaler's
    business. Nothing here waits for the device."""
    optimizer, scaler = trainee.optimizer, trainee.scaler
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        trainee.model.parameters(), t.clip_norm or float("inf")
    )
    grad_bad = ~torch.isfinite(grad_norm)
    loss_bad = ~torch.isfinite(loss_sum)
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
        bad, skipped = loss_bad, grad_bad
    else:
        bad = skipped = loss_bad | grad_bad
        optimizer.found_inf = skipped.float()  # the fused kernel skips the update when 1
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, grad_norm.detach(), bad, skipped)


def train_step(
    trainee: Trainee, batches: list[Batch], step_tokens: float, t: TrainConfig
) -> StepResult:
    """One optimizer step on the micro-batches `batches`: `accumulate`, then `update`."""
    loss_sum = accumulate(
        trainee.runner, batches, step_tokens, trainee.world, trainee.precision, trainee.scaler, t
    )
    return update(trainee, loss_sum, t)


class StepMeter:
    """Sums of what the steps measure, kept on the device and read on the host (`read`)."""

    def __init__(self, device: torch.device, bad_run: int = 0) -> None:
        """`bad_run`: the consecutive non-finite steps a resumed run had reached."""
        self._values = torch.zeros(5, dtype=torch.float64, device=device)
        self._values[2] = bad_run
        self._carry = torch.tensor([False, True, True, False, False], device=device)
        self.grad_norm = float("nan")  # of the last step read
        self.bad_run = bad_run  # the current run of bad steps, as of the last read

    def add(self, r: StepResult) -> None:
        """loss sum, last grad norm, consecutive bad steps, skipped steps, and the longest
        run of consecutive bad steps since the last read."""
        v = self._values
        bad = r.bad.to(v.dtype)
        run = (v[2] + 1) * bad
        self._values = torch.stack(
            [
                v[0] + r.loss,
                r.grad_norm.to(v.dtype),
                run,
                v[3] + r.skipped,
                torch.maximum(v[4], run),
            ]
        )

    def read(self) -> tuple[float, int, int]:
        """(loss sum and skipped steps since the last read, the longest run of consecutive
        bad steps since then): one transfer from the device. The current run carries over,
        so a run read in two parts counts whole; one that ended between two reads (on CUDA,
        read every train.log_every steps) is still seen."""
        loss, self.grad_norm, current, skipped, longest = self._values.tolist()
        self._values = torch.where(self._carry, self._values, 0.0)
        self.bad_run = int(current)
        return loss, int(skipped), int(longest)


@dataclass
class LogWindow:
    """The loss and its target tokens since the last log record; and for the training rate,
    target tokens and step time since the last record, validation or save, and when that
    stretch began (a record's `rate_tokens`, `step_seconds` and `tokens_per_s` are that
    stretch's: fewer tokens than since the last record where a validation or save fell in
    between)."""

    loss: float = 0.0
    loss_tokens: int = 0
    tokens: int = 0
    step_seconds: float = 0.0  # in train_step (CPU: the compute; CUDA: queueing it)
    opened: float = 0.0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new stretch of the training rate (after a validation or a save); the loss is
        averaged over the steps since the last record all the same (a resumed run's first
        record, after the save it resumed from, is the uninterrupted run's)."""
        self.tokens, self.step_seconds = 0, 0.0
        self.opened = time.perf_counter()

    def record(self, progress: TrainProgress, lr: float, grad_norm: float) -> dict[str, Any]:
        """The metrics record of the window, which then starts anew."""
        now = time.perf_counter()
        record = {
            "kind": "train",
            "step": progress.step,
            "epoch": progress.epoch,
            "loss": self.loss / max(self.loss_tokens, 1),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self.tokens / max(now - self.opened, 1e-9),
            "minutes": progress.seconds / 60,
            "tokens": progress.tokens,
            "skipped": progress.skipped_steps,
            "step_seconds": self.step_seconds,
            "rate_tokens": self.tokens,  # the target tokens tokens_per_s and step_seconds cover
        }
        self.tokens, self.step_seconds, self.opened = 0, 0.0, now
        self.loss, self.loss_tokens = 0.0, 0
        return record


# -- the data of each step ------------------------------------------------------------------


def device_steps(
    split: EncodedSplit, steps: list[tuple[list[Any], int]], device: torch.device
) -> Iterator[tuple[list[Batch], int]]:
    """The micro-batches of each step on the device, with the step's token count. On CUDA
    they are collated into pinned memory and their copies queued one step ahead, so the
    host never waits for a copy (collating the next step while the GPU works on this one);
    the copies run on the compute stream, between the steps' kernels, not beside them."""
    pin = device.type == "cuda"
    pending = None
    for indices, tokens in steps:
        ready = ([split.collate(i, pin=pin).to(device) for i in indices], tokens)
        if pending is not None:
            yield pending
        pending = ready
    if pending is not None:
        yield pending


# -- validation -----------------------------------------------------------------------------


def validation_loss(
    model: torch.nn.Module, split: EncodedSplit, cfg: Config, device, precision
) -> dict:
    """Mean NLL (and perplexity) per target token on a split, in fixed batches."""
    batches = TokenBatches.of(split, cfg.train, shuffle=False)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    model.eval()
    with torch.no_grad(), autocast(device, precision):
        for idx in batches.epoch(0):
            b = split.collate(idx).to(device)
            logits = model(b.src, b.src_mask, b.tgt_in, b.src_lengths)
            nll += label_smoothed_loss(logits, b.tgt_out, 0.0)
            tokens += b.tgt_tokens
    loss = float(nll) / max(tokens, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}


def validate(
    model, prepared: Prepared, split: EncodedSplit, cfg: Config, device, precision
) -> dict:
    """Loss and perplexity on the validation split, and with train.valid_bleu BLEU and chrF
    of its translations (train.valid_beam, the first train.valid_max_sentences)."""
    record = validation_loss(model, split, cfg, device, precision)
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


def early_stop_metric(t: TrainConfig) -> str:
    return t.early_stop_metric if t.valid_bleu or t.early_stop_metric == "loss" else "loss"


def book_validation(record: dict[str, Any], progress: TrainProgress, t: TrainConfig) -> bool:
    """Enter a validation record in the progress: marks it best or not, keeps it in the
    history; returns whether it is the best so far. Records of averaged weights (they carry
    `averaged`) leave the early-stopping and plateau counters alone."""
    metric = early_stop_metric(t)
    record["best"] = better(metric, record[metric], progress.best_value)
    if record["best"]:
        progress.best_value, progress.best_step = record[metric], progress.step
    progress.history.append(record)
    if "averaged" in record:
        return record["best"]
    progress.bad_validations = 0 if record["best"] else progress.bad_validations + 1
    if t.schedule == "plateau":
        progress.plateau_bad = 0 if record["best"] else progress.plateau_bad + 1
        if progress.plateau_bad > t.plateau_patience:
            progress.plateau_scale *= t.plateau_factor
            progress.plateau_bad = 0
    return record["best"]


# -- checkpoints ----------------------------------------------------------------------------


class Checkpointer:
    """Writes the run's checkpoints (rank 0): last.pt, step-N.pt (the newest train.keep_last
    kept) and best.pt, each self-describing (config, vocabulary, tokenizer, progress, RNG)."""

    def __init__(self, run: RunDir, cfg: Config, vocab: Vocab, prepared: Prepared) -> None:
        self.run, self.cfg, self.vocab, self.prepared = run, cfg, vocab, prepared

    def payload(
        self, trainee: Trainee, progress: TrainProgress, rngs: list[dict], **extra: Any
    ) -> dict[str, Any]:
        v = self.vocab
        return {
            **extra,
            "config": self.cfg.to_dict(),
            "arch": arch_of(self.cfg.model),
            "vocab": {"src_size": v.src_size, "tgt_size": v.tgt_size, "shared": v.shared},
            "model": trainee.model.state_dict(),
            "optimizer": trainee.optimizer.state_dict(),
            "scaler": trainee.scaler.state_dict() if trainee.scaler.is_enabled() else {},
            "progress": progress.to_dict(),
            "rng": rngs,
            "tokenizer": self.run.tokenizer_files(),
            "prepared": str(self.prepared.dir),
            "run_dir": str(self.run.path.resolve()),  # the tokenizer's home if the file moves
        }

    def save(self, kind: str, payload: dict[str, Any], step: int) -> None:
        """kind: "best", "last", or "step" (step-N.pt, then last.pt: a run killed between the
        two resumes from the save before and writes step-N.pt again). Step checkpoints beyond
        the newest train.keep_last are removed (also after a resume that lowered it)."""
        if kind == "best":
            checkpoint.save(payload, self.run.checkpoint("best"))
            return
        if kind == "step" and self.cfg.train.keep_last > 0:
            checkpoint.save(payload, self.run.step_checkpoint(step))
        checkpoint.save(payload, self.run.checkpoint("last"))
        self._prune()

    def _prune(self) -> None:
        keep = self.cfg.train.keep_last
        kept = self.run.step_checkpoints()
        for old in kept[:-keep] if keep else kept:
            old.unlink()

    def resumed(self, progress: TrainProgress) -> None:
        """A run resumed from a last.pt that stopped at a train.save_every step (a signal, a
        budget since raised) gets that step's step-N.pt, as the run that went on has it
        (keep_last and average_last count on it): last.pt's state, not finished."""
        t = self.cfg.train
        step = progress.step
        if t.keep_last > 0 and step > 0 and step % t.save_every == 0:
            target = self.run.step_checkpoint(step)
            if not target.exists():
                payload = checkpoint.load(self.run.checkpoint("last"))
                payload["progress"] = {**payload["progress"], "finished": ""}
                checkpoint.save(payload, target)
        self._prune()

    def latest_saves(self, step: int, k: int) -> dict[int, Path]:
        """The newest `k` saves by step: step checkpoints and last.pt (at `step`)."""
        saves = {step_of(p): p for p in self.run.step_checkpoints()}
        saves[step] = self.run.checkpoint("last")
        return {s: saves[s] for s in sorted(saves)[-k:]}


# -- signals --------------------------------------------------------------------------------


class Signals:
    """SIGINT/SIGTERM: finish the current step, checkpoint, exit cleanly."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Signals:
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


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back for the scope (files that must change together: a
    Ctrl-C between them left best.pt promoted and last.pt unaware), then delivered."""
    with Signals() as signals:
        yield
    if signals.received:
        signal.raise_signal(signal.Signals[signals.received])


# -- the trainer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """What stays fixed while a run trains, for the phases of the loop."""

    cfg: Config
    run: RunDir
    prepared: Prepared
    valid: EncodedSplit
    device: torch.device
    world: World
    saver: Checkpointer
    reporter: Reporter
    runlog: RunLog | None  # rank 0 only


def check_start(run: RunDir, cfg: Config, resume: bool) -> TrainProgress | str | None:
    """What this call starts from: None for a new run, the progress of the run to resume, or
    (a string) why the run has nothing left to train. Raises for a run it must not touch."""
    state = run.state(cfg.train if resume else None)
    if not resume and state.kind in ("resumable", "finished"):
        raise NMTError(
            f"{run} already holds a trained run; continue it with --resume or choose another "
            "--run-dir"
        )
    if resume and state.kind in ("empty", "configured"):
        raise NMTError(
            f"nothing to resume: {run.checkpoint('last')} does not exist; drop --resume to start"
        )
    if resume and state.kind in ("resumable", "finished"):
        check_resumable(run.checkpoint("last"), cfg)
    if state.kind == "finished":
        return state.reason
    return state.progress


def check_resumable(path: Path, cfg: Config) -> None:
    """`NMTError` unless the checkpoint at `path` is one training wrote of `cfg`'s model (its
    architecture, its model section, and the data and tokenizer sections that say what its
    token ids are), with its optimizer state: checked before the run directory is written
    (`resume_from` loads it later)."""
    payload = checkpoint.load(path, mmap=True)
    recipe = {"arch": arch_of(cfg.model), "config": cfg.to_dict()}
    # the model, and the data and tokenizer its token ids are of (a last.pt copied from a
    # run on other data was resumed)
    if difference := checkpoint.model_difference(payload, recipe):
        what, theirs, ours = difference
        what = "architecture" if what == "arch" else what
        raise NMTError(
            f"cannot resume from {path}: it holds another model than the recipe's (its {what} "
            f"is {theirs}, the recipe's {ours}); resume a run with the recipe it was trained "
            "with"
        )
    if payload.get("optimizer") is None:
        raise NMTError(
            f"cannot resume from {path}: it holds no optimizer state (an average?); resume "
            "from a checkpoint training wrote"
        )


def resume_from(
    run: RunDir, trainee: Trainee, batches: TokenBatches, t: TrainConfig, reporter: Reporter
) -> TrainProgress:
    """Load last.pt into the trainee; restore the RNG states and the data position. Exact when
    as many processes resume as saved the run; otherwise the position in the epoch and the
    RNG states are re-derived, and the reporter says so."""
    path = run.checkpoint("last")
    payload = checkpoint.load(path)
    try:  # its architecture and model section are the recipe's (`check_resumable`)
        trainee.model.load_state_dict(payload["model"])
        trainee.optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        # torch's first line only says that loading failed; the next one says what differs
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [repr(e)]
        detail = lines[1] if len(lines) > 1 else lines[0]
        detail = detail if len(detail) <= 160 else detail[:157] + "..."
        raise NMTError(
            f"cannot resume from {path}: it holds another model than the recipe's "
            f"({detail}); resume a run with the recipe it was trained with"
        ) from None
    if payload.get("scaler"):
        trainee.scaler.load_state_dict(payload["scaler"])
    progress = TrainProgress.from_dict(payload["progress"])
    world, saved = trainee.world, len(payload["rng"])
    exact = distributed.restore_rngs(payload["rng"], world, trainee.device, t.seed, progress.step)
    if saved != world.size:
        progress.batch_in_epoch = batches.resume_start(
            progress.epoch, progress.batch_in_epoch, saved
        )
    if not exact and world.is_main:
        reporter.message(
            f"resuming with {world.size} process(es) a run saved by {saved}: the position in "
            "the epoch and the random states are re-derived, so the run is not bit-exact"
        )
    progress.finished = ""  # this invocation's budgets decide when the run is complete
    return progress


INTERRUPTED = "interrupted"  # a stop reason's start when a signal stopped training


def decide(progress: TrainProgress, t: TrainConfig, signals: Signals, world: World) -> str:
    """Why training stops after this step ('' to go on): a budget (steps, epochs, minutes) or
    a signal. Every rank must stop at the same step: they agree on the host flags (a signal
    received, the clock past train.max_minutes) in one all-reduce."""
    over_time = t.max_minutes is not None and progress.seconds >= t.max_minutes * 60
    flags = [float(signals.received is not None), float(over_time)]
    got_signal, out_of_time = distributed.host_sum(flags, world)
    reason = spent_budget(progress, t, out_of_time=out_of_time > 0)
    if not reason and got_signal:
        reason = f"{INTERRUPTED} ({signals.received or 'signal on another rank'})"
    return reason


def validate_and_book(
    s: Session, trainee: Trainee, progress: TrainProgress, rngs: list[dict], **extra: Any
) -> dict[str, Any]:
    """Rank 0: validate the model's current weights, log the record, keep it in the history,
    save best.pt when it is the best so far. Returns the record.

    The allocator's free pages go back to the kernel before and after: the step's free blocks
    would not serve validation's sizes, nor validation's the step's, and each would stay
    resident beside the other (4.5-minute runs of the transformer recipe: 1.89-1.92 GB between
    validations instead of 1.94-1.98)."""
    allocator.release_free_memory()
    record = validate(trainee.model, s.prepared, s.valid, s.cfg, s.device, trainee.precision)
    allocator.release_free_memory()
    record.update({"kind": "valid", "step": progress.step, "epoch": progress.epoch})
    record.update({"minutes": progress.seconds / 60, "tokens": progress.tokens, **extra})
    book_validation(record, progress, s.cfg.train)
    s.runlog.record(record)
    s.reporter.validation(record)
    s.runlog.info("validation: %s", json.dumps(record))
    if record["best"]:
        s.saver.save("best", s.saver.payload(trainee, progress, rngs, **extra), progress.step)
    return record


def validation_says_stop(
    s: Session, trainee: Trainee, progress: TrainProgress, rngs: list[dict]
) -> bool:
    """Validate (rank 0; the others wait), then whether early stopping ends training. Every
    rank takes the plateau schedule's scale of the learning rate that rank 0's validations
    set: ranks stepping with other rates would train apart (DDP averages their gradients,
    never their weights)."""
    t = s.cfg.train
    stop = scale = 0.0
    if s.world.is_main:
        validate_and_book(s, trainee, progress, rngs)
        stop = float(t.patience is not None and progress.bad_validations >= t.patience)
        scale = progress.plateau_scale
    trainee.model.train()
    stop, progress.plateau_scale = distributed.host_sum([stop, scale], s.world)
    return stop > 0


def average_last_saves(
    s: Session, trainee: Trainee, progress: TrainProgress, rngs: list[dict]
) -> None:
    """Rank 0, at the end of a finished run: validate the average of the last
    `train.average_last` saves like a checkpoint of its own (best.pt when it beats every
    single one); last.pt keeps the final weights, with the history that now holds it."""
    saves = s.saver.latest_saves(progress.step, s.cfg.train.average_last)
    if len(saves) < 2:
        s.reporter.message(f"train.average_last: only {len(saves)} save(s); nothing to average")
        return
    trained = {k: v.clone() for k, v in trainee.model.state_dict().items()}
    trainee.model.load_state_dict(checkpoint.average(list(saves.values()))["model"])
    validate_and_book(s, trainee, progress, rngs, averaged=list(saves))
    trainee.model.load_state_dict(trained)
    trainee.model.train()
    s.saver.save("last", s.saver.payload(trainee, progress, rngs), progress.step)


def validate_average(
    run: RunDir, averaged: dict[str, Any], device: torch.device
) -> tuple[dict[str, Any], bool]:
    """`nmt average`: validate averaged weights as training validates a checkpoint (the
    run's config, validation split and precision). When they beat the run's best validation
    (train.early_stop_metric), they become best.pt, and the record joins the
    run's history (last.pt, metrics.jsonl), as `train.average_last` does at the end of a run.
    Returns the record and whether the average was promoted. The caller holds the lock."""
    from nmt.config import from_dict

    cfg = from_dict(averaged["config"])
    prepared = prepare(cfg)
    model = build_model(averaged["arch"], cfg.model, Vocab(**averaged["vocab"])).to(device)
    model.load_state_dict(averaged["model"])
    # the precision training validated in; fp16 (a GPU's run) computes on CUDA only: fp32
    precision = cfg.train.precision
    if precision == "fp16" and device.type != "cuda":
        precision = "fp32"
    precision = resolve_precision(precision, device)
    configure_device(device, cfg.train.tf32)  # as training validated
    record = validate(model, prepared, prepared.split("valid"), cfg, device, precision)
    last = checkpoint.load(run.checkpoint("last"))
    progress = TrainProgress.from_dict(last["progress"])
    record.update({"kind": "valid", "step": progress.step, "epoch": progress.epoch})
    record.update({"minutes": progress.seconds / 60, "tokens": progress.tokens})
    record["averaged"] = averaged["averaged"]
    metric = early_stop_metric(cfg.train)
    record["best"] = better(metric, record[metric], progress.best_value)
    if not record["best"]:
        return record, False
    progress.best_value, progress.best_step = record[metric], progress.step
    progress.history.append(record)
    with signals_deferred():  # best.pt, last.pt and metrics.jsonl tell one story
        checkpoint.save({**averaged, "progress": progress.to_dict()}, run.checkpoint("best"))
        checkpoint.save({**last, "progress": progress.to_dict()}, run.checkpoint("last"))
        with RunLog(run, None, cfg.train.tensorboard) as runlog:
            runlog.record(record)
            runlog.info("validation: %s", json.dumps(record))
    return record, True


def train(
    cfg: Config,
    run_dir: Path,
    resume: bool = False,
    reporter: Reporter | None = None,
) -> Result:
    """Train `cfg` into `run_dir`, or resume the run there (see the module docstring)."""
    reporter = reporter or NullReporter()
    t = cfg.train
    run = RunDir(run_dir)
    world = distributed.world_from_env()
    device, precision = preflight(cfg)
    device = distributed.rank_device(device, world)

    # Refuse what must not start before any work; check again under the lock (rank 0, the
    # writer; the other ranks' checks read only).
    if world.is_main:
        run.check_not_written()
    check_start(run, cfg, resume)
    prepared = prepare(cfg)  # every rank: the first to ask prepares, the others reuse it
    with contextlib.ExitStack() as held:
        if world.is_main:
            held.enter_context(run.writer())  # the only writer of the run until we return
        start = check_start(run, cfg, resume)
        if isinstance(start, str):  # a finished run: report, touch nothing
            reporter.message(nothing_to_train(run, start))
            last = checkpoint.load(run.checkpoint("last"))
            return Result(run.path, TrainProgress.from_dict(last["progress"]), start)
        if world.is_main:
            run.attach(cfg, prepared.tokenizer_files)
            split = prepared.split("train")
            batches = TokenBatches.of(split, t)
            reporter.prepared(prepared, batches.padding_fraction())
        distributed.join(world, device, t.dist_timeout_minutes)
        held.callback(distributed.leave, world)
        configure_device(device, t.tf32)
        held.enter_context(deterministic_algorithms(t.deterministic))
        result = train_loop(cfg, run, prepared, precision, world, start, device, reporter)
        finish = getattr(reporter, "finish", None)  # (a reporter written before it: none)
        if finish is not None:
            finish(result.progress)  # where training ended (between log records too)
        return result


def train_loop(
    cfg: Config,
    run: RunDir,
    prepared: Prepared,
    precision: str,
    world: World,
    resumed: TrainProgress | None,
    device: torch.device,
    reporter: Reporter,
) -> Result:
    """The loop of `train`, once the run is checked, prepared, locked and joined."""
    t = cfg.train
    v = prepared.summary["vocab"]
    vocab = Vocab(src_size=v["src"], tgt_size=v["tgt"], shared=v["joint"])
    trainee = build_trainee(cfg, vocab, device, precision, world)
    train_split = prepared.split("train")
    batches = TokenBatches.of(train_split, t, True, world.rank, world.size)
    progress = TrainProgress()
    if resumed is not None:
        progress = resume_from(run, trainee, batches, t, reporter)
    wrap(trainee, t.compile)
    steps_per_epoch = math.ceil(len(batches.epoch(0)) / t.accumulate)
    # the last step (cosine decays to it): the first of the step and epoch budgets to end
    ends = [t.max_steps, t.max_epochs * steps_per_epoch if t.max_epochs else None]
    total_steps = min((n for n in ends if n), default=None)
    read_every = 1 if device.type == "cpu" else t.log_every  # host reads: free on CPU only
    bad_run = progress.nonfinite_run  # a resumed run goes on where it stood at its save
    meter, window, first_step = StepMeter(device, bad_run), LogWindow(), progress.step
    window.loss, window.loss_tokens = progress.log_loss, progress.log_loss_tokens
    start_time = time.perf_counter() - progress.seconds
    stop_reason = ""
    trainee.model.train()

    with contextlib.ExitStack() as closing, Signals() as signals:
        runlog = None
        if world.is_main:
            runlog = closing.enter_context(
                RunLog(run, progress.step, t.tensorboard)  # 0 for a new run
            )
            info = start_info(cfg, trainee, prepared, batches, progress, total_steps, resumed)
            reporter.start(info)
            runlog.info("resolved config:\n%s", cfg.to_yaml())
            runlog.info("start: %s", json.dumps(info))
            runlog.info("data: %s", json.dumps(prepared.summary))
        s = Session(
            cfg,
            run,
            prepared,
            prepared.split("valid"),
            device,
            world,
            Checkpointer(run, cfg, vocab, prepared),
            reporter,
            runlog,
        )
        if resumed is not None and world.is_main:
            s.saver.resumed(progress)
        while not stop_reason:
            epoch_steps = batches.steps(progress.epoch, t.accumulate, progress.batch_in_epoch)
            if not epoch_steps:  # a checkpoint saved at the very end of an epoch
                progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
                stop_reason = progress.finished = spent_budget(progress, t)
                continue
            feed = device_steps(train_split, epoch_steps, device)
            for k, (group, step_tokens) in enumerate(feed):
                # Schedule: the LR is a pure function of the step.
                step_start = time.perf_counter()
                lr = lr_at(progress.step + 1, t, total_steps) * progress.plateau_scale
                for param_group in trainee.optimizer.param_groups:
                    param_group["lr"] = lr
                # Step: accumulate, clip, update (a non-finite step leaves the weights alone).
                meter.add(train_step(trainee, group, step_tokens, t))
                window.step_seconds += time.perf_counter() - step_start
                progress.step += 1
                progress.batch_in_epoch += len(group)
                progress.tokens += step_tokens
                progress.seconds = time.perf_counter() - start_time
                progress.train_seconds += time.perf_counter() - step_start
                window.tokens += step_tokens
                window.loss_tokens += step_tokens
                # Measure: read the device's sums when due, log.
                logging_now = progress.step % t.log_every == 0
                read = logging_now or progress.step % read_every == 0
                if read:
                    bad_run = measure(meter, window, progress)
                    if logging_now and world.is_main:
                        record = window.record(progress, lr, meter.grad_norm)
                        runlog.record(record)
                        reporter.log(record)
                if k == len(epoch_steps) - 1:  # the epoch's last step
                    progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
                # Decide: non-finite losses, budgets and signals, agreed by every rank.
                stop_reason = decide(progress, t, signals, world)
                # validation at the end of training, not at an interruption: it would move the
                # state a resumed run goes on from (best, patience, plateau), which an
                # uninterrupted run has not
                ends = bool(stop_reason) and not stop_reason.startswith(INTERRUPTED)
                due = ends or progress.step % t.valid_every == 0
                save_due = bool(stop_reason) or progress.step % t.save_every == 0
                if (due or save_due) and not read:  # checkpoints hold exact counts
                    bad_run = measure(meter, window, progress)
                if bad_run >= t.max_nonfinite:
                    stop_reason, due, save_due = (
                        non_finite_stop(bad_run, trainee.precision),
                        True,
                        True,
                    )
                if due or save_due:  # what a save holds for a resumed run (best.pt's too)
                    progress.log_loss, progress.log_loss_tokens = window.loss, window.loss_tokens
                    progress.nonfinite_run = meter.bad_run
                # Validate and checkpoint (RNG states as of the end of this step).
                rngs = []
                if due or save_due:
                    rngs = distributed.gather(distributed.rng_state(device), world)
                # early stopping ends the run even where a signal arrived at that step (the
                # uninterrupted run ends there: a resumed one must not train on)
                if due and validation_says_stop(s, trainee, progress, rngs):
                    if not stop_reason or stop_reason.startswith(INTERRUPTED):
                        stop_reason = f"early stopping: no improvement in {t.patience} validations"
                    save_due = True
                if stop_reason.startswith(("reached", "early stopping")):
                    progress.finished = stop_reason
                if save_due and world.is_main:
                    kind = "last" if stop_reason else "step"
                    s.saver.save(kind, s.saver.payload(trainee, progress, rngs), progress.step)
                if progress.finished and t.average_last > 1 and world.is_main:
                    average_last_saves(s, trainee, progress, rngs)
                if stop_reason:
                    break
                if due or save_due:  # keep tokens/s about training only
                    window.reset()
        if runlog is not None:
            runlog.info("end: %s at step %d", stop_reason, progress.step)
    received = signals.received if stop_reason.startswith(INTERRUPTED) else None
    return Result(run.path, progress, stop_reason, progress.step - first_step, received)


def measure(meter: StepMeter, window: LogWindow, progress: TrainProgress) -> int:
    """Read the meter into the log window and the progress; the consecutive bad steps."""
    loss_sum, skipped, bad_run = meter.read()
    window.loss += loss_sum
    progress.skipped_steps += skipped
    return bad_run


def non_finite_stop(bad_run: int, precision: str) -> str:
    """The stop reason; what to change is trained anew (a run keeps the lr and precision it
    was trained with: --resume refuses another value), fp32 suggested only to a run not in it."""
    fp32 = "" if precision == "fp32" else " or train.precision=fp32"
    return (
        f"stopped: the loss was not finite for {bad_run} consecutive steps; train a new run "
        f"(another --run-dir) with a lower train.lr{fp32} (this run's last.pt holds its last "
        "good weights)"
    )


def start_info(
    cfg: Config,
    trainee: Trainee,
    prepared: Prepared,
    batches: TokenBatches,
    progress: TrainProgress,
    total_steps: int | None,
    resumed: TrainProgress | None,
) -> dict[str, Any]:
    """What the reporter and train.log say when training starts."""
    return {
        "arch": arch_of(cfg.model),
        "params": count_parameters(trainee.model),
        "device": str(trainee.device),
        "precision": trainee.precision,
        "allocator": allocator.in_use(),  # glibc, or the library `nmt.allocator` preloaded
        "world": trainee.world.size,
        "train_pairs": prepared.summary["splits"]["train"]["pairs"],
        "valid_pairs": prepared.summary["splits"]["valid"]["pairs"],
        "steps_per_epoch": math.ceil(len(batches.epoch(0)) / cfg.train.accumulate),
        "total_steps": total_steps,
        "max_minutes": cfg.train.max_minutes,
        "max_tokens": cfg.train.max_tokens,
        "resumed_from": progress.step if resumed is not None else None,
        "padding": batches.padding_fraction(progress.epoch),
    }
