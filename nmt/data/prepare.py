"""`nmt prepare`: load, clean, train the tokenizer, encode, filter and cache every split.

The result lives in `<cache>/prepared/<key>/`, where the key hashes the data and tokenizer
settings (and the identity of local input files), so recipes that share a data section share
one prepared dataset, and a second `prepare` with unchanged settings does no work.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nmt import NMTError
from nmt.config import Config, DataConfig
from nmt.data.batching import EncodedSplit
from nmt.data.sources import (
    CORPORA,
    cache_root,
    edited_local_files,
    fingerprint,
    load_split,
    resolve_text,
)
from nmt.data.tokenizer import Encoder, Tokenizer, train_tokenizer
from nmt.files import alive

if TYPE_CHECKING:  # imported where data is prepared: reusing prepared data never needs it
    import datasets

log = logging.getLogger(__name__)


def encoded_features() -> datasets.Features:
    """The columns of a prepared split: the text, its token ids and their counts."""
    import datasets

    return datasets.Features(
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
        base, n = name, len(names)
        while name in names:  # a file name another test set has: the first free suffix
            name, n = f"{base}_{n}", n + 1
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
        path = self.dir / "splits" / name
        split = EncodedSplit.load(path)
        pairs = self.summary["splits"][name].get("pairs", len(split))
        if len(split) != pairs:  # an Arrow file cut between two record batches still reads
            raise NMTError(
                f"the prepared split in {path} holds {len(split)} pairs "
                f"where {pairs} were prepared; delete {self.dir} and run `nmt prepare` again"
            )
        return split

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.dir)

    @property
    def tokenizer_files(self) -> list[Path]:
        """The sentencepiece model file(s) a run trained on this data needs."""
        return sorted(self.dir.glob("spm*.model"))


def _input_files(cfg: DataConfig) -> list[Path]:
    if cfg.source == "text":
        splits = split_names(cfg).values()
        return [resolve_text(s, lang) for s in splits for lang in (cfg.src, cfg.tgt)]
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
        inputs = fingerprint(*files) if files else ""
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
    """Prepare (or reuse) the data for `cfg`; see the module docstring. Processes that ask for
    the same data at once (the ranks of a distributed run, parallel runs) take turns on a lock
    beside it: the first prepares, the others reuse its result."""
    existing = load_prepared(cfg)
    if existing is not None:
        return existing
    final = prepared_dir(cfg)
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        try:
            existing = load_prepared(cfg)
            return existing if existing is not None else _prepare_locked(cfg, final)
        finally:
            # No file left behind. A process waiting on this (now nameless) file re-checks
            # for the data when it gets the lock; one arriving later locks a new file.
            lock_path.unlink(missing_ok=True)


def _prepare_locked(cfg: Config, final: Path) -> Prepared:
    # What a process killed while preparing this data left (SIGTERM and SIGKILL run no
    # cleanup): work folders of processes that are gone. A live one may still be working
    # (the lock file is unlinked when its holder ends: a newcomer can hold a new one).
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        pid = stale.name.rpartition("-")[2]
        if pid.isdecimal() and (int(pid) == os.getpid() or not alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    work = final.parent / f".tmp-{final.name}-{os.getpid()}"
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
        encoded[name] = ds.map(
            encoder, batched=True, num_proc=num_proc, features=encoded_features()
        )
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
        split = EncodedSplit.from_dataset(ds)
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
