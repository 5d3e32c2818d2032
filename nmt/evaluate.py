"""Translate lines or prepared splits with a trained model (scoring: `nmt.metrics`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nmt import NMTError, checkpoint
from nmt.config import Config, DecodeConfig, from_dict
from nmt.data.tokenizer import Tokenizer
from nmt.device import autocast, configure_host
from nmt.models.base import Vocab
from nmt.models.layers import packed_weights
from nmt.models.registry import build_model
from nmt.search import Hypothesis, SearchOptions, search
from nmt.special import EOS_ID, PAD_ID


@dataclass
class Loaded:
    model: torch.nn.Module
    config: Config
    tokenizer: Tokenizer
    run_dir: Path
    checkpoint: Path
    payload: dict[str, Any]


def read_run(path: Path) -> tuple[Path, dict[str, Any], Config, Tokenizer]:
    """The checkpoint (of a run directory, or the file given), its payload, config and
    tokenizer: what `load_model` reads, without building the model or applying the
    process settings (the benchmarks' peers read a run this way)."""
    ckpt = checkpoint.resolve(Path(path))
    payload = checkpoint.load(ckpt)
    tok_dir = checkpoint.tokenizer_dir(ckpt, payload)
    if not tok_dir.is_dir():
        raise NMTError(
            f"no tokenizer for {ckpt}: {tok_dir} does not exist; keep checkpoints in "
            "RUN_DIR/checkpoints/, beside the run's tokenizer/ folder"
        )
    return ckpt, payload, from_dict(payload["config"]), Tokenizer.from_dir(tok_dir)


def load_model(path: Path, device: torch.device) -> Loaded:
    """Model, config and tokenizer from a run directory or a checkpoint file."""
    configure_host()
    ckpt, payload, cfg, tokenizer = read_run(path)
    model = build_model(payload["arch"], cfg.model, Vocab(**payload["vocab"]))
    model.load_state_dict(payload["model"])
    model.to(device).eval()
    run_dir = checkpoint.tokenizer_dir(ckpt, payload).parent
    return Loaded(model, cfg, tokenizer, run_dir, ckpt, payload)


def search_options(d: DecodeConfig, **overrides: Any) -> SearchOptions:
    base = {
        "beam": d.beam,
        "nbest": d.nbest,
        "length_penalty": d.length_penalty,
        "max_len_a": d.max_len_a,
        "max_len_b": d.max_len_b,
        "min_len": d.min_len,
        "no_repeat_ngram": d.no_repeat_ngram,
        "ban_unk": d.ban_unk,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    opts = SearchOptions(**base)
    for ok, problem in (
        (opts.beam >= 1, f"the beam size must be >= 1 (got {opts.beam})"),
        (opts.temperature > 0, f"--temperature must be > 0 (got {opts.temperature})"),
        (0 < opts.top_p <= 1, f"--top-p must be in (0, 1] (got {opts.top_p})"),
        (opts.top_k >= 0, f"--top-k must be >= 0, 0 = no top-k filter (got {opts.top_k})"),
    ):
        if not ok:
            raise NMTError(problem)
    return opts


def decode_workers(workers: int, device: torch.device, batches: int) -> int:
    """How many batches to decode at once: `workers`, or for 0 (auto) 2 on a CPU with 2 or
    more intra-op threads and 1 otherwise; never more than there are batches. On CUDA and
    MPS 1: the device is the bottleneck, not the host."""
    if device.type != "cpu":
        return 1
    wanted = workers or (2 if torch.get_num_threads() >= 2 else 1)
    return max(1, min(wanted, batches))


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to n for the scope (threads started in it use n)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def map_in_workers(
    fn: Callable[[Any], Any],
    items: list,
    workers: int,
    done: Callable[[Any], None] | None = None,
    stop: threading.Event | None = None,
) -> list:
    """[fn(x) for x in items], `workers` items at once in threads that split torch's intra-op
    threads between them (one at a time for 1); done(x) after each result, in item order.
    On an error or Ctrl-C the items not started are dropped, and `stop` is set (as soon as
    any item fails, whichever) before the running ones are waited for: an fn that watches it
    (a search does, at every step) ends early, so Ctrl-C stops a decode at once instead of
    after the batches in flight (~1 s). The first error an item raised is raised, not the
    stops it caused in the others."""
    results = []
    if workers == 1:
        for x in items:
            results.append(fn(x))
            if done:
                done(x)
        return results
    failed: list[BaseException] = []  # errors in the order the items raised them

    def on_done(future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            failed.append(future.exception())
            if stop is not None:
                stop.set()

    with intra_op_threads(max(1, torch.get_num_threads() // workers)):
        pool = ThreadPoolExecutor(workers, thread_name_prefix="nmt-decode")
        futures = [pool.submit(fn, x) for x in items]
        for future in futures:
            future.add_done_callback(on_done)
        try:
            for x, future in zip(items, futures):
                try:
                    results.append(future.result())
                except Exception as e:
                    raise (failed[0] if failed else e) from None
                if done:
                    done(x)
        except BaseException:
            if stop is not None:
                stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return results


def decode_batches(
    model: torch.nn.Module,
    batches: list[Tensor],
    opts: SearchOptions,
    device: torch.device,
    precision: str,
    workers: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[list[list[Hypothesis]]]:
    """Search every batch src[B,S] (EOS-terminated, PAD-padded); results in batch order.

    On CPU, `workers` batches (`decode_workers`) are decoded at once by threads that share the
    cores (`map_in_workers`: 2 threads give 2 workers x 1). Most of a decoding step that is
    not a matrix product (softmax, top-k, cache copies, Python) runs on one core while the
    other waits; two batches in flight keep both busy. Beam 5 on the Multi30k-sized
    transformer, 2 cores, 1,024 sentences in batches of 64, in one process: 1 worker x 2
    threads 110-113 sentences/s in fp32, 152-165 in bf16; 2 workers x 1 thread 122-126 and
    196-198, the same outputs (3 workers: 116-123 / 190-196). Each batch is searched as it
    would be alone; the weights are packed once for all of them.
    """
    model.eval()
    stop = threading.Event()  # set on an error or Ctrl-C: the batches in flight end early

    def run(src: Tensor) -> list[list[Hypothesis]]:
        src = src.to(device)
        with autocast(device, precision):  # thread-local, as is search's inference mode
            return search(model, src, src != PAD_ID, opts, stop)

    done = (lambda src: progress(src.size(0))) if progress else None
    n_workers = decode_workers(workers, device, len(batches))
    with packed_weights(model):
        return map_in_workers(run, batches, n_workers, done, stop)


def decode_ids(
    model: torch.nn.Module,
    sources: list[list[int]],
    opts: SearchOptions,
    batch_tokens: int,
    device: torch.device,
    precision: str,
    progress: Callable[[int], None] | None = None,
    workers: int = 0,
) -> list[list[Hypothesis]]:
    """Decode token-id sources (without EOS) in length-sorted batches; results in input order."""
    lengths = np.array([len(s) + 1 for s in sources])
    order = np.argsort(lengths, kind="stable")
    groups, batches = [], []
    start = 0
    while start < len(order):
        # Sentences sorted by length: grow the batch while it fits the token budget.
        end = start + 1
        while (
            end < len(order) and (end - start + 1) * lengths[order[end]] * opts.beam <= batch_tokens
        ):
            end += 1
        idx = order[start:end]
        src = torch.full((len(idx), int(lengths[idx].max())), PAD_ID, dtype=torch.long)
        for row, i in enumerate(idx):
            src[row, : len(sources[i])] = torch.as_tensor(sources[i], dtype=torch.long)
            src[row, len(sources[i])] = EOS_ID
        groups.append(idx)
        batches.append(src)
        start = end
    results: list[list[Hypothesis]] = [[] for _ in sources]
    decoded = decode_batches(model, batches, opts, device, precision, workers, progress)
    for idx, hyps in zip(groups, decoded):
        for i, nbest in zip(idx, hyps):
            results[int(i)] = nbest
    return results


def translate_lines(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    lines: list[str],
    opts: SearchOptions,
    batch_tokens: int,
    device: torch.device,
    precision: str,
    progress: Callable[[int], None] | None = None,
    workers: int = 0,
) -> list[list[tuple[str, Hypothesis]]]:
    """n-best (text, hypothesis) per input line; empty lines give an empty list."""
    stripped = [line.strip() for line in lines]
    todo = [i for i, line in enumerate(stripped) if line]
    ids = tokenizer.encode_src([stripped[i] for i in todo])
    hyps = decode_ids(model, ids, opts, batch_tokens, device, precision, progress, workers)
    out: list[list[tuple[str, Hypothesis]]] = [[] for _ in lines]
    for i, nbest in zip(todo, hyps):
        texts = tokenizer.decode_tgt([h.tokens for h in nbest])
        out[i] = list(zip(texts, nbest))
    return out


def translate_texts(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    lines: list[str],
    d: DecodeConfig,
    device: torch.device,
    precision: str,
    beam: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Best translation of every line with decoding settings `d` (beam overridable)."""
    opts = search_options(d, beam=beam, nbest=1)
    results = translate_lines(
        model, tokenizer, lines, opts, d.batch_tokens, device, precision, progress, d.workers
    )
    return [nbest[0][0] if nbest else "" for nbest in results]


def evaluate_run(
    run: Path,
    split: str | None,
    beam: int | None,
    precision: str | None,
    device: torch.device,
    console: Any = None,
) -> tuple[list[str], list[str], Path, str]:
    """Translate a prepared split with a run's model; returns hypotheses, references, the
    file the hypotheses were written to (RUN/translations/SPLIT.TGT) and the target language."""
    from nmt.data.prepare import prepare
    from nmt.device import resolve_precision

    loaded = load_model(run, device)
    cfg = loaded.config
    prepared = prepare(cfg)
    name = split or next(
        (s for s in prepared.summary["splits"] if s not in ("train", "valid")), "valid"
    )
    data = prepared.split(name)
    prec = resolve_precision(precision or cfg.decode.precision, device)
    sources = data.texts("src")  # encoded with the run's own tokenizer, not the cache's
    if console is not None:
        from rich.progress import Progress

        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"translating {name}", total=len(data))
            hyps = translate_texts(
                loaded.model,
                loaded.tokenizer,
                sources,
                cfg.decode,
                device,
                prec,
                beam,
                progress=lambda n: bar.advance(task, n),
            )
    else:
        hyps = translate_texts(
            loaded.model, loaded.tokenizer, sources, cfg.decode, device, prec, beam
        )
    out_dir = loaded.run_dir / "translations"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"{name}.{cfg.data.tgt}"
    path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    return hyps, data.texts("tgt"), path, cfg.data.tgt
