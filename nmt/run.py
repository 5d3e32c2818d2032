"""A run directory: the only code that knows its layout, its state and its writer lock.

    RUN/
      config.yaml        the resolved config the run trains (written by `nmt prepare`/`train`)
      tokenizer/         its sentencepiece model(s)
      checkpoints/       last.pt (resume), best.pt (best validation), step-N.pt, averaged.pt
      metrics.jsonl      one JSON record per training log line and per validation
      train.log          the same in words, with the resolved config
      tensorboard/       event files, with train.tensorboard
      translations/      `nmt evaluate RUN --split S` writes S.LANG here
      exports/           ctranslate2-QUANTIZATION/: the model exported for `--engine ctranslate2`
                         (`nmt.export`), with the stamp of the checkpoint it was made from
      .lock              the writer lock (see `RunDir.writer`)

A run is in one of four states (`RunDir.state`): empty, configured (config and tokenizer, no
checkpoint), resumable (last.pt, budget left), finished (last.pt, budget spent).
`TrainProgress` is what moves while a run trains; `spent_budget` is the one rule saying when a
budget is spent. No torch here: the CLI and `nmt compare` read runs without loading models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from nmt import NMTError
from nmt.config import DATA_LOCATION, Config, ConfigError, TrainConfig, read_yaml
from nmt.files import is_temporary, remove_stale_temporaries, write_atomic

if TYPE_CHECKING:
    from nmt.data.prepare import Prepared

log = logging.getLogger(__name__)

CHECKPOINT_KINDS = ("last", "best", "averaged")


@dataclass
class TrainProgress:
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
    # where the log window and the run of non-finite steps stand at this save, so that a
    # resumed run logs and stops as the uninterrupted one does
    log_loss: float = 0.0  # loss summed since the last train record
    log_loss_tokens: int = 0  # ... over this many target tokens
    nonfinite_run: int = 0  # consecutive non-finite steps up to this one
    finished: str = ""  # why a completed run ended (budget, early stopping); empty otherwise
    history: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainProgress:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def spent_budget(progress: TrainProgress, t: TrainConfig, out_of_time: bool | None = None) -> str:
    """Why a run cannot train further under the budgets of `t` ('' when it can): the first of
    train.max_steps, max_epochs, max_tokens, max_minutes reached, or early stopping that the patience of
    `t` confirms. `out_of_time` overrides the clock test (ranks agree on it: `nmt.train`)."""
    if out_of_time is None:
        out_of_time = t.max_minutes is not None and progress.seconds >= t.max_minutes * 60
    if t.max_steps is not None and progress.step >= t.max_steps:
        return f"reached train.max_steps={t.max_steps}"
    if t.max_epochs is not None and progress.epoch >= t.max_epochs:
        return f"reached train.max_epochs={t.max_epochs}"
    if t.max_tokens is not None and progress.tokens >= t.max_tokens:
        return f"reached train.max_tokens={t.max_tokens}"
    if out_of_time:
        return f"reached train.max_minutes={t.max_minutes}"
    # patience spent, whatever else ended the run then (a budget, a signal at that step)
    if t.patience is not None and progress.bad_validations >= t.patience:
        return f"early stopping: no improvement in {t.patience} validations"
    return ""


@dataclass(frozen=True)
class RunState:
    """What a run directory holds. `reason`: why a finished run trains no further."""

    kind: Literal["empty", "configured", "resumable", "finished"]
    progress: TrainProgress | None = None
    reason: str = ""


class RunDir:
    """The files of one run (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __str__(self) -> str:
        return str(self.path)

    # -- layout ------------------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, kind: str) -> Path:
        """checkpoints/{last,best,averaged}.pt."""
        if kind not in CHECKPOINT_KINDS:
            raise ValueError(f"unknown checkpoint kind {kind!r}")
        return self.checkpoints_dir / f"{kind}.pt"

    def trained(self) -> bool:
        """Whether training saved a checkpoint here (a temporary file a killed save left is
        none)."""
        return self.checkpoints_dir.is_dir() and any(
            not p.name.startswith(".") for p in self.checkpoints_dir.glob("*.pt")
        )

    def step_checkpoint(self, step: int) -> Path:
        return self.checkpoints_dir / f"step-{step}.pt"

    def step_checkpoints(self) -> list[Path]:
        """Kept step checkpoints (step-N.pt, N in digits), oldest first."""
        paths = (p for p in self.checkpoints_dir.glob("step-*.pt") if _step_text(p).isdecimal())
        return sorted(paths, key=step_of)

    def is_step_checkpoint(self, path: Path) -> bool:
        """Whether `path` is in this run's checkpoints/ folder with a step-*.pt name (a file
        there named as training's saves is taken for one, or looks like one)."""
        path = Path(path)
        return (
            path.name.startswith("step-")
            and path.suffix == ".pt"
            and path.resolve().parent == self.checkpoints_dir.resolve()
        )

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def log_file(self) -> Path:
        return self.path / "train.log"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    def translation_file(self, split: str, lang: str, tag: str = "") -> Path:
        """translations/SPLIT.LANG, or SPLIT.TAG.LANG (an ensemble's translations)."""
        return self.path / "translations" / (f"{split}.{tag}.{lang}" if tag else f"{split}.{lang}")

    def export_dir(self, name: str) -> Path:
        """exports/NAME: an export of the run's model kept for decoding (`nmt.export`)."""
        return self.path / "exports" / name

    @property
    def lock_file(self) -> Path:
        return self.path / ".lock"

    # -- what a reader loads ----------------------------------------------------------------
    def model_checkpoint(self) -> Path:
        """The checkpoint that stands for the run: best.pt, else last.pt, else averaged.pt."""
        for kind in ("best", "last", "averaged"):
            if self.checkpoint(kind).is_file():
                return self.checkpoint(kind)
        raise NMTError(
            f"no checkpoint in {self.checkpoints_dir}; train a model there with `nmt train`"
        )

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> RunDir:
        """The run a checkpoint file was saved in: the parent of its checkpoints/ folder."""
        return cls(Path(checkpoint).resolve().parent.parent)

    @staticmethod
    def tokenizer_of(checkpoint: Path, recorded_run: str | None) -> Path:
        """A checkpoint's tokenizer folder: beside its checkpoints/ folder, else in the run
        directory the checkpoint records (a checkpoint copied or averaged elsewhere)."""
        here = RunDir.of_checkpoint(checkpoint).tokenizer_dir
        if here.is_dir() or not recorded_run:
            return here
        return RunDir(recorded_run).tokenizer_dir

    # -- state --------------------------------------------------------------------------------
    def check_is_dir(self) -> None:
        """Refuse (`NMTError`) a path that is a file, or a folder holding other files than a
        run's: a run would write its config.yaml, logs and folders over them."""
        if self.path.exists() and not self.path.is_dir():
            raise NMTError(f"{self.path} is a file, not a run directory; choose another --run-dir")
        if self.path.is_dir() and not self._holds_a_run():
            if self.trained():
                raise NMTError(
                    f"{self.path} holds checkpoints but no config.yaml of nmt's (removed or "
                    "replaced?): the run's settings are lost with it; put it back, or train "
                    "in another --run-dir"
                )
            raise NMTError(
                f"{self.path} holds files of its own and no nmt run (no config.yaml written by "
                "nmt); choose a new or empty --run-dir"
            )

    def _holds_a_run(self) -> bool:
        """Empty (but for the writer lock), or holding the config.yaml nmt writes: a mapping
        of recipe sections."""
        names = {p.name for p in self.path.iterdir()} - {self.lock_file.name}
        if all(is_temporary(name) for name in names):  # nothing but nmt's own, being written
            return True
        try:
            stored = read_yaml(self.config_file)
        except (ConfigError, OSError):
            return False
        return bool(stored) and stored.keys() <= {f.name for f in dataclasses.fields(Config)}

    def state(self, budget: TrainConfig | None = None) -> RunState:
        """The run's state. With `budget`, a run with a checkpoint is finished when that budget
        is spent (`spent_budget`); without, when it ended under its own budget. A damaged
        last.pt raises `NMTError`, as loading it does."""
        from nmt import checkpoint  # torch, only when there is a checkpoint to read

        self.check_is_dir()
        last = self.checkpoint("last")
        if not last.is_file():
            configured = self.config_file.is_file() and self.tokenizer_dir.is_dir()
            return RunState("configured" if configured else "empty")
        progress = TrainProgress.from_dict(checkpoint.load(last)["progress"])
        reason = spent_budget(progress, budget) if budget is not None else progress.finished
        return RunState("finished" if reason else "resumable", progress, reason)

    def tokenizer_files(self) -> list[str]:
        """Names of the run's sentencepiece model file(s) (recorded in checkpoints)."""
        return sorted(f.name for f in self.tokenizer_dir.glob("spm*.model"))

    def attach(self, cfg: Config, tokenizer_files: list[Path]) -> None:
        """Make the run self-describing: its resolved config and tokenizer model(s). A run
        with checkpoints keeps its config but for the keys a resumed run may change
        (`RESUMABLE`): another value of any other key is refused."""
        self.check_is_dir()
        self.path.mkdir(parents=True, exist_ok=True)
        text = cfg.to_yaml()
        trained = self.trained()
        if self.config_file.is_file() and self.config_file.read_text(encoding="utf-8") != text:
            if trained:
                old = _flatten(self._stored_config())
                new = _flatten(cfg.to_dict())
                changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
                fixed = [k for k in changed if not k.startswith(RESUMABLE)]
                if fixed:
                    raise NMTError(
                        f"{self.path} already holds a run trained with a different config "
                        f"({', '.join(fixed)}); choose another --run-dir or delete that directory"
                    )
        if trained:  # the same config: is it still the same data?
            self._check_same_tokenizer(tokenizer_files)
        write_atomic(self.config_file, text)
        self.tokenizer_dir.mkdir(exist_ok=True)
        models = {f.name: f for f in tokenizer_files}
        for stale in self.tokenizer_dir.glob("spm*.model"):  # an earlier tokenizer setting's
            if stale.name not in models:
                stale.unlink()
        for name, f in models.items():
            write_atomic(self.tokenizer_dir / name, f.read_bytes())

    def _check_same_tokenizer(self, tokenizer_files: list[Path]) -> None:
        """A trained run's checkpoints read token ids of its tokenizer: refused (`NMTError`)
        when the data prepared now trained another one (its text changed since, the recipe
        did not), which would be written over the run's."""
        from nmt.data.tokenizer import same_vocabulary

        have = {f.name: f for f in self.tokenizer_dir.glob("spm*.model")}
        given = {f.name: f for f in tokenizer_files}
        if have and (
            have.keys() != given.keys() or not all(same_vocabulary(have[n], given[n]) for n in have)
        ):
            raise NMTError(
                f"{self.path} already holds a run trained with another tokenizer: the data "
                "it was prepared from has changed since, and its checkpoints' token ids mean "
                "other pieces now; restore that data, or train a new run in another --run-dir"
            )

    def _stored_config(self) -> dict[str, Any]:
        """config.yaml as written; an older nmt's lacks later keys, read as it ran them."""
        from nmt import config

        return config.as_it_ran(config.read_yaml(self.config_file))

    def saved_config(self, overrides: list[str]):
        """The run's own config.yaml with `overrides` on top (what a resumed run trains)."""
        from nmt import config

        return config.from_dict(config.apply_overrides(self._stored_config(), overrides))

    # -- the writer lock ---------------------------------------------------------------------
    def check_not_written(self) -> None:
        """Refuse (`NMTError` naming the holder) when another process holds the writer lock;
        creates nothing. A quick check before work that would be wasted; `writer` decides."""
        self.check_is_dir()
        try:  # read-only: a run one may only read (another user's) can be checked too
            fd = os.open(self.lock_file, os.O_RDONLY)
        except (FileNotFoundError, PermissionError):
            return
        try:
            self._lock(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            raise NMTError(
                f"{self.path} is being written by another process ({holder or 'unknown'}); "
                "wait for it to finish or choose another --run-dir"
            ) from None

    @contextlib.contextmanager
    def writer(self) -> Iterator[None]:
        """Hold the run's writer lock for the scope: a second process that asks for it is
        refused at once (`NMTError` naming the holder's pid and host). An OS lock
        (`fcntl.flock` on RUN/.lock), so a killed holder never blocks the next writer; the
        file keeps the holder's pid, host and command while it is held and is emptied on
        release. Readers (translate, evaluate) take no lock: checkpoints are written
        atomically. Creates the run directory."""
        self.check_is_dir()
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._lock(fd)
            command = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}: {command}\n".encode(), 0)
            for folder in (self.path, self.checkpoints_dir, self.tokenizer_dir):
                remove_stale_temporaries(folder)  # what writers killed mid-write left
            try:
                yield
            finally:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # -- metrics ------------------------------------------------------------------------------
    def metrics(self) -> list[dict[str, Any]]:
        """The records of metrics.jsonl (none when there is no such file yet)."""
        return read_metrics(self.metrics_file) if self.metrics_file.is_file() else []


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file. A last line cut short (the run was killed while
    writing it) is left out; any other line that is not a JSON record is an error."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
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
                f"{path}, line {i + 1}, is not a JSON record; repair that line or delete the "
                "file (the checkpoints keep the validation history)"
            ) from None
    return records


# Keys a run may change when it is resumed: budgets, logging cadence, decoding, and where
# and how its data is read (the same data: not in the prepared-data key, `Config.data_key`).
RESUMABLE = (
    *(f"data.{key}" for key in DATA_LOCATION),
    "train.max_steps",
    "train.max_epochs",
    "train.max_minutes",
    "train.max_tokens",
    "train.log_every",
    "train.valid_every",
    "train.save_every",
    "train.keep_last",
    "train.patience",
    "train.max_nonfinite",
    "train.tensorboard",
    "train.valid_max_sentences",
    "decode.",
)


def attach(prepared: Prepared, cfg: Config, run_dir: Path) -> None:
    """`RunDir(run_dir).attach` with the tokenizer of `prepared`."""
    RunDir(run_dir).attach(cfg, prepared.tokenizer_files)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def default_run_dir(recipe: Path) -> Path:
    """Where `nmt train RECIPE` trains without --run-dir: runs/<recipe folder>_<recipe name>."""
    recipe = Path(recipe)
    parent = recipe.resolve().parent.name
    return Path("runs") / (f"{parent}_{recipe.stem}" if parent != "recipes" else recipe.stem)


def _step_text(path: Path) -> str:
    return path.stem.removeprefix("step-") if path.stem.isascii() else ""


def step_of(path: Path) -> int:
    """The step of a step-N.pt checkpoint."""
    return int(_step_text(path))


class RunLog:
    """Where a training run writes what happens: metrics.jsonl, train.log and (optionally)
    TensorBoard. Opened by training (`start_step`: the step it starts from), it first drops
    the records logged after that step: a killed run may have logged steps it will now
    repeat, or half a line; a new run (step 0) keeps none, not even those of an attempt
    killed before its first checkpoint. `start_step` None appends (a record after training)."""

    def __init__(self, run: RunDir, start_step: int | None, tensorboard: bool) -> None:
        run.path.mkdir(parents=True, exist_ok=True)
        keep = None  # the records to write anew, when some are dropped
        if start_step is not None and run.metrics_file.is_file():
            keep = [r for r in run.metrics() if r["step"] <= start_step] if start_step else []
        elif run.metrics_file.is_file() and not _ends_a_line(run.metrics_file):
            keep = run.metrics()  # half a line a killed run left: dropped, as reading drops it
        if keep is not None:
            write_atomic(run.metrics_file, "".join(json.dumps(r) + "\n" for r in keep))
        self._metrics = open(run.metrics_file, "a", encoding="utf-8")  # noqa: SIM115
        self._logger = logging.getLogger(f"nmt.run.{run.path.resolve()}")
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False
        self._handler = logging.FileHandler(run.log_file, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        self._logger.addHandler(self._handler)
        self._tb = _tensorboard(run) if tensorboard else None

    def record(self, record: dict[str, Any]) -> None:
        """One metrics record (`kind`, `step`, values): metrics.jsonl and TensorBoard."""
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self._tb.add_scalar(f"{record['kind']}/{k}", v, record["step"])

    def info(self, message: str, *args: Any) -> None:
        """A line of train.log."""
        self._logger.info(message, *args)

    def close(self) -> None:
        self._metrics.close()
        self._logger.removeHandler(self._handler)
        self._handler.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _ends_a_line(path: Path) -> bool:
    """Whether the file is empty or its last byte ends a line."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _tensorboard(run: RunDir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("train.tensorboard is on but tensorboard is not installed; skipping it")
        return None
    return SummaryWriter(str(run.tensorboard_dir))
