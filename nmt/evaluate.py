"""`nmt evaluate RUN --split S`: translate a prepared split with a run's model, keep the
translations in the run (RUN/translations/S.LANG, written whole or not at all). Scoring is
`nmt.metrics`'; decoding `nmt.translate`'s."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nmt.data.prepare import prepare
from nmt.device import resolve_precision
from nmt.files import write_lines
from nmt.run import RunDir
from nmt.translate import load_models, translate_texts


@dataclass
class SplitTranslation:
    hyps: list[str]
    refs: list[str]
    path: Path  # where the hypotheses were written
    tgt_lang: str
    split: str


def default_test_split(splits: list[str]) -> str:
    """The split `nmt evaluate RUN` scores without --split: the first test split, else valid."""
    return next((s for s in splits if s not in ("train", "valid")), "valid")


def translate_split(
    runs: list[Path],
    split: str | None,
    beam: int | None,
    precision: str | None,
    device: torch.device,
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> SplitTranslation:
    """Translate prepared split `split` (default: `default_test_split`) with the model of a
    run directory or checkpoint (several: their ensemble, written as SPLIT.ensemble-HASH.LANG
    in the first run), its decode settings (`beam` and `precision` overriding them).
    `progress(total)` returns the function told each finished batch's size."""
    loaded = load_models(runs, device)
    cfg = loaded.config
    prepared = prepare(cfg)
    name = split or default_test_split(list(prepared.summary["splits"]))
    data = prepared.split(name)
    prec = resolve_precision(precision or cfg.decode.precision, device)
    sources = data.texts("src")  # encoded with the run's own tokenizer, not the cache's
    tick = progress(len(sources)) if progress is not None else None
    hyps = translate_texts(
        loaded.model, loaded.tokenizer, sources, cfg.decode, device, prec, beam, progress=tick
    )
    tag = ""
    if loaded.members:
        members = "\n".join(str(m.checkpoint.resolve()) for m in loaded.members)
        tag = "ensemble-" + hashlib.sha256(members.encode()).hexdigest()[:8]
    path = RunDir(loaded.run_dir).translation_file(name, cfg.data.tgt, tag)
    write_lines(path, hyps)
    return SplitTranslation(hyps, data.texts("tgt"), path, cfg.data.tgt, name)
