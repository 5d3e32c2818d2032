"""Self-describing checkpoints: atomic save, safe load (`weights_only=True`), averaging.

A checkpoint is a dict of tensors and plain Python values: model and optimizer state, step,
data position, RNG states, the resolved config, the tokenizer reference and the metrics
history, so `nmt translate RUN_DIR` needs nothing else.
"""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from nmt import NMTError, first_line
from nmt.config import DATA_LOCATION
from nmt.files import sync_dir

FORMAT = "nmt-checkpoint-1"


def save(payload: dict[str, Any], path: Path) -> None:
    """Write atomically: temporary file, flush + fsync, rename. A crash at any moment leaves
    the previous file at `path` intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    sync_dir(path.parent)


def load(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Load with `weights_only=True`; refuse files that need arbitrary code, truncated files
    and files that are not nmt checkpoints, with one clear message. With `mmap` the tensors
    stay in the file's pages (read when touched, copied on write) instead of all being read
    into memory: for reading a part, such as the model of a checkpoint that also holds its
    optimizer's state."""
    path = Path(path)
    if not path.is_file():
        raise NMTError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # A pickled class or function, not just tensors. torch words this differently for an
        # unknown class ("Unsupported global: GLOBAL x.Y") and a blocked module ("unsupported
        # GLOBAL posix.system whose module posix is blocked"); both name the GLOBAL opcode.
        if "GLOBAL" in str(e):
            raise NMTError(
                f"refusing {path}: it needs arbitrary code to load (weights_only=True failed); "
                "only load checkpoints written by nmt"
            ) from None
        raise NMTError(f"cannot read checkpoint {path}: truncated or not a checkpoint") from None
    except Exception as e:  # torch raises many types for truncated or foreign files
        raise NMTError(
            f"cannot read checkpoint {path}: truncated or not a checkpoint ({first_line(e)})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise NMTError(f"{path} is not an nmt checkpoint (no {FORMAT!r} marker)")
    return payload


def model_difference(
    payload: dict[str, Any],
    other: dict[str, Any],
    sections: tuple[str, ...] = ("model", "data", "tokenizer"),
) -> tuple[str, Any, Any] | None:
    """What makes two checkpoints (or a checkpoint and what a config says of its model) hold
    different models, as (what, payload's, other's); None: the same one, whose weights can be
    averaged or trained on. The architecture, the vocabulary (where both say it), or a key
    of the config's `sections` that both have (a checkpoint of an older nmt may lack new
    keys; the data and tokenizer say what the token ids mean)."""
    for key in ("arch", "vocab"):
        if key in payload and key in other and payload[key] != other[key]:
            return key, payload[key], other[key]
    for section in sections:
        a, b = payload["config"].get(section) or {}, other["config"].get(section) or {}
        skip = DATA_LOCATION if section == "data" else ()  # where data was read, not what
        for key in sorted(a.keys() & b.keys()):
            if key not in skip and a[key] != b[key]:
                return f"{section}.{key}", a[key], b[key]
    return None


def average(paths: list[Path]) -> dict[str, Any]:
    """Average the model parameters of several checkpoints of the same model
    (`model_difference`)."""
    if not paths:
        raise NMTError("nothing to average: no checkpoints given")
    payloads = [load(p, mmap=True) for p in paths]  # only their models are read
    first = payloads[0]
    for p, other in zip(paths[1:], payloads[1:]):
        if difference := model_difference(other, first):
            what, theirs, ours = difference
            raise NMTError(
                f"cannot average {p} with {paths[0]}: another model ({what} {theirs} against "
                f"{ours})"
            )
    avg = {}
    for key, value in first["model"].items():
        if not value.is_floating_point():
            avg[key] = value.clone()  # in memory, not in the file's pages
            continue
        for p, other in zip(paths, payloads):
            if key not in other["model"] or other["model"][key].shape != value.shape:
                raise NMTError(f"cannot average {p}: its model differs from {paths[0]}")
        avg[key] = (
            sum(o["model"][key].double() for o in payloads).div(len(payloads)).to(value.dtype)
        )
    # Config, progress, vocabulary and run directory (where the tokenizer lives, so the
    # average works wherever it is written) of the last checkpoint given.
    newest = payloads[-1]
    keep = {k: v for k, v in newest.items() if k not in ("model", "optimizer", "format", "scaler")}
    keep = copy.deepcopy(keep)  # its tensors (random states) in memory, not in the file's pages
    return {**keep, "model": avg, "averaged_from": [str(p) for p in paths]}
