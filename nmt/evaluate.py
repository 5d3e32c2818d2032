"""`nmt evaluate RUN --split S`: translate a prepared split with a run's model, keep the
translations in the run (RUN/translations/S.LANG, written whole or not at all). Scoring is
`nmt.metrics`'; decoding an engine's (`nmt.engine`: nmt's own search or CTranslate2)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nmt import config
from nmt.data.prepare import prepare
from nmt.decode_process import helping
from nmt.engine import open_engine
from nmt.files import write_lines
from nmt.run import RunDir
from nmt.translate import search_options


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
    overrides: list[str] | None = None,
    engine: str = "nmt",
    quantization: str | None = None,
    before: Callable[[str, int], None] | None = None,
) -> SplitTranslation:
    """Translate prepared split `split` (default: `default_test_split`) with the model of a
    run directory or checkpoint (several: their ensemble, written as SPLIT.ensemble-HASH.LANG
    in the first run), its decode settings (`beam`, and `decode.KEY=VALUE` `overrides`, on
    top), by `engine` (`nmt.engine.open_engine`: nmt in `precision`, or CTranslate2 in
    `quantization`). `progress(total)` returns the function told each finished batch's size;
    `before(target language, lines)` is called before anything is decoded or written (checks
    of what comes after)."""
    decoder = open_engine(runs, engine, device, precision, quantization)
    cfg = decoder.config
    d = config.replace(cfg, overrides).decode if overrides else cfg.decode
    opts = search_options(d, beam=beam, nbest=1)
    decoder.check(opts)
    prepared = prepare(cfg)
    name = split or default_test_split(list(prepared.summary["splits"]))
    data = prepared.split(name)
    sources = data.texts("src")  # encoded with the run's own tokenizer, not the cache's
    if before is not None:
        before(cfg.data.tgt, len(sources))
    tick = progress(len(sources)) if progress is not None else None
    with helping(decoder, len(sources), opts, d.workers):  # many lines: child processes
        results = decoder.translate(sources, opts, d.batch_tokens, tick, d.workers)
    hyps = [nbest[0][0] if nbest else "" for nbest in results]
    tag = ""
    if len(decoder.checkpoints) > 1:
        members = "\n".join(str(c.resolve()) for c in decoder.checkpoints)
        tag = "ensemble-" + hashlib.sha256(members.encode()).hexdigest()[:8]
    path = RunDir(decoder.run_dir).translation_file(name, cfg.data.tgt, tag)
    write_lines(path, hyps)
    return SplitTranslation(hyps, data.texts("tgt"), path, cfg.data.tgt, name)
