"""`nmt prepare`: load, clean, train the tokenizer, encode, filter and cache every split.

The result lives in `<cache>/prepared/<key>/`, where the key hashes the data and tokenizer
settings (and the identity of local input files), so recipes that share a data section share
one prepared dataset, and a second `prepare` with unchanged settings does no work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import yaml

from nmt import NMTError
from nmt.config import Config, DataConfig
from nmt.data.batching import EncodedSplit
from nmt.data.sources import (
    CORPORA,
    _fingerprint,
    _resolve_text,
    cache_root,
    edited_local_files,
    load_split,
)
from nmt.data.tokenizer import Encoder, Tokenizer, train_tokenizer

log = logging.getLogger(__name__)

ENCODED = datasets.Features(
    {
        "src": datasets.Value("string"),
        "tgt": datasets.Value("string"),
        "src_ids": datasets.Sequence(datasets.Value("int32")),
        "tgt_ids": datasets.Sequence(datasets.Value("int32")),
        "src_len": datasets.Value("int32"),
        "tgt_len": datasets.Value("int32"),
    }
)


def split_names(cfg: DataConfig) -> dict[str, str]:
    """Prepared split name -> configured split (split name, path prefix or file)."""
    names = {"train": cfg.train, "valid": cfg.valid}
    for test in cfg.test:
        name = (
            test if cfg.source in CORPORA or cfg.source == "hub" else Path(test).name.split(".")[0]
        )
        if name in names:
            name = f"{name}_{len(names)}"
        names[name] = test
    return names


@dataclass(frozen=True)
class Prepared:
    dir: Path
    summary: dict
    reused: bool

    def split(self, name: str) -> EncodedSplit:
        if name not in self.summary["splits"]:
            raise NMTError(
                f"unknown split {name!r}; prepared splits: {', '.join(self.summary['splits'])}"
            )
        return EncodedSplit.load(self.dir / "splits" / name)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.dir)


def _input_files(cfg: DataConfig) -> list[Path]:
    if cfg.source == "text":
        splits = split_names(cfg).values()
        return [_resolve_text(s, lang) for s in splits for lang in (cfg.src, cfg.tgt)]
    if cfg.source in ("tsv", "jsonl"):
        files = [Path(s) for s in split_names(cfg).values()]
        for f in files:
            if not f.is_file():
                raise NMTError(f"file not found: {f} (check data.train/valid/test in the recipe)")
        return files
    if cfg.source == "hub" and cfg.hub_name and Path(cfg.hub_name).is_dir():
        # a local dataset (save_to_disk, or data files): prepared again when any file changes
        files = Path(cfg.hub_name).rglob("*")  # (datasets' cache-*.arrow are not data)
        return sorted(p for p in files if p.is_file() and not p.name.startswith("cache-"))
    return []


def prepared_dir(cfg: Config) -> Path:
    """The cache folder of a config's prepared data: its data and tokenizer settings, plus
    the state of the input files (path, size, modification time of text/TSV/JSONL files and
    local hub datasets; the content of a named corpus' local copy where it is not the
    published one), so edited inputs are prepared again."""
    key = cfg.data_key()
    if cfg.data.source in CORPORA:
        inputs = edited_local_files(cfg.data, split_names(cfg.data).values())
    else:
        files = _input_files(cfg.data)
        inputs = _fingerprint(*files) if files else ""
    if inputs:
        key = hashlib.sha256((key + inputs).encode()).hexdigest()[:16]
    return cache_root(cfg.data) / "prepared" / key


def load_prepared(cfg: Config) -> Prepared | None:
    final = prepared_dir(cfg)
    summary = final / "summary.json"
    if not summary.is_file():
        return None
    return Prepared(final, json.loads(summary.read_text()), reused=True)


def _strip(batch: dict) -> dict:
    return {"src": [s.strip() for s in batch["src"]], "tgt": [t.strip() for t in batch["tgt"]]}


def _column(ds: datasets.Dataset, name: str) -> np.ndarray:
    return np.asarray(ds.data.table.column(name).to_numpy()) if len(ds) else np.zeros(0, np.int64)


def prepare(cfg: Config) -> Prepared:
    """Prepare (or reuse) the data for `cfg`; see the module docstring."""
    existing = load_prepared(cfg)
    if existing is not None:
        return existing
    final = prepared_dir(cfg)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        summary = {"key": final.name, **_prepare_into(cfg, work)}
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
        shutil.rmtree(work / "datasets-cache", ignore_errors=True)
        try:
            os.replace(work, final)
        except OSError:  # another process prepared the same data meanwhile
            if not (final / "summary.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Prepared(final, summary, reused=False)


def _prepare_into(cfg: Config, work: Path) -> dict:
    t0 = time.perf_counter()
    d = cfg.data
    names = split_names(d)
    num_proc = d.num_proc if d.num_proc > 1 else None
    raw: dict[str, datasets.Dataset] = {}
    for name, split in names.items():
        ds = load_split(d, split, work)
        limit = {"train": d.limit_train, "valid": d.limit_valid}.get(name, d.limit_test)
        if limit is not None and limit < len(ds):
            ds = ds.select(range(limit))
        if name != "train" and len(ds) == 0:  # validation and scoring need sentences
            raise NMTError(
                f"the {name} split ({split}) holds no sentence pairs; point it at a non-empty corpus"
            )
        raw[name] = ds

    # Cleaning (training split only): strip, drop empty sides; lengths are checked after encoding.
    train = raw["train"].map(_strip, batched=True, num_proc=num_proc)
    n_raw = len(train)
    train = train.filter(
        lambda b: [bool(s) and bool(t) for s, t in zip(b["src"], b["tgt"])],
        batched=True,
        num_proc=num_proc,
    )
    dropped = {"empty": n_raw - len(train), "too_long": 0, "ratio": 0}
    if len(train) == 0:
        raise NMTError(
            f"training corpus is empty after filtering ({n_raw} pairs read, all with an empty "
            "side); check data.train and the language codes"
        )

    t_tok = time.perf_counter()
    train_tokenizer(train, cfg.tokenizer, work)
    tok = Tokenizer.from_dir(work)
    t_tok = time.perf_counter() - t_tok

    t_enc = time.perf_counter()
    encoder = Encoder(str(tok.src_model), str(tok.tgt_model))
    encoded: dict[str, datasets.Dataset] = {}
    for name, ds in {**raw, "train": train}.items():
        encoded[name] = ds.map(encoder, batched=True, num_proc=num_proc, features=ENCODED)
    t_enc = time.perf_counter() - t_enc

    # Length filters on subword tokens, training split only.
    train = encoded["train"]
    src_len, tgt_len = _column(train, "src_len"), _column(train, "tgt_len")
    too_long = (src_len > d.max_len) | (tgt_len > d.max_len)
    ratio = np.maximum(src_len, tgt_len) / np.maximum(np.minimum(src_len, tgt_len), 1)
    bad_ratio = ~too_long & (ratio > d.max_ratio)
    dropped["too_long"], dropped["ratio"] = int(too_long.sum()), int(bad_ratio.sum())
    keep = np.flatnonzero(~(too_long | bad_ratio))
    if len(keep) == 0:
        raise NMTError(
            "training corpus is empty after filtering (every pair is over data.max_len="
            f"{d.max_len} or data.max_ratio={d.max_ratio}); raise those limits"
        )
    if len(keep) < len(train):
        encoded["train"] = train.select(keep)

    splits = {}
    for name, ds in encoded.items():
        ds.save_to_disk(str(work / "splits" / name))
        split = EncodedSplit(ds)
        splits[name] = {
            "source": names[name],
            "pairs": len(ds),
            "src_tokens_mean": float(split.src_lens.mean()) if len(split) else 0.0,
            "tgt_tokens_mean": float(split.tgt_lens.mean()) if len(split) else 0.0,
        }
    return {
        "src": d.src,
        "tgt": d.tgt,
        "splits": splits,
        "train_read": n_raw,
        "dropped": dropped,
        "vocab": {
            "joint": tok.joint,
            "src": tok.src.get_piece_size(),
            "tgt": tok.tgt.get_piece_size(),
        },
        "seconds": {
            "tokenizer": round(t_tok, 3),
            "encode": round(t_enc, 3),
            "total": round(time.perf_counter() - t0, 3),
        },
    }


def attach(prepared: Prepared, cfg: Config, run_dir: Path) -> None:
    """Make `run_dir` self-describing: resolved config and tokenizer model(s)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    text = cfg.to_yaml()
    if config_path.is_file() and config_path.read_text(encoding="utf-8") != text:
        if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            old = _flatten(yaml.safe_load(config_path.read_text(encoding="utf-8")) or {})
            new = _flatten(cfg.to_dict())
            changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            fixed = [k for k in changed if not k.startswith(RESUMABLE)]
            if fixed:
                raise NMTError(
                    f"{run_dir} already holds a run trained with a different config ({', '.join(fixed)}); "
                    "choose another --run-dir or delete that directory"
                )
    write_atomic(config_path, text)
    tok_dir = run_dir / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    models = {f.name: f for f in prepared.dir.glob("spm*.model")}
    for stale in tok_dir.glob("spm*.model"):  # from an earlier tokenizer setting of this run
        if stale.name not in models:
            stale.unlink()
    for name, f in models.items():
        write_atomic(tok_dir / name, f.read_bytes())


# Keys a run may change when it is resumed: budgets, logging cadence, decoding.
RESUMABLE = (
    "train.max_steps",
    "train.max_epochs",
    "train.max_minutes",
    "train.log_every",
    "train.valid_every",
    "train.save_every",
    "train.keep_last",
    "train.patience",
    "train.tensorboard",
    "train.valid_max_sentences",
    "decode.",
)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def write_atomic(path: Path, content: str | bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    data = content.encode("utf-8") if isinstance(content, str) else content
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
