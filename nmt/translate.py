"""Decoding with a trained model: load a run's model, batch sources, search, and the
attention of one translation. What `nmt translate`, `nmt evaluate`, validation and `nmt
compare` decode with (scoring: `nmt.metrics`; a prepared split: `nmt.evaluate`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nmt import NMTError, checkpoint
from nmt.config import Config, DecodeConfig, from_dict
from nmt.data.batching import pack
from nmt.data.tokenizer import Tokenizer
from nmt.device import autocast, configure_device
from nmt.models.base import Vocab, count_parameters, fixed_weights
from nmt.models.ensemble import Ensemble
from nmt.models.registry import build_model
from nmt.run import RunDir
from nmt.search import Hypothesis, SearchOptions, ends_after, force_decode, search
from nmt.special import EOS_ID, PAD_ID

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    model: torch.nn.Module  # an `Ensemble` of the members' models when there are several
    config: Config
    tokenizer: Tokenizer
    run_dir: Path
    checkpoint: Path
    payload: dict[str, Any]
    members: list[Loaded] = field(default_factory=list)  # an ensemble's runs, in order

    @property
    def arch(self) -> str:
        return "+".join(m.payload["arch"] for m in self.members) or self.payload["arch"]


def model_facts(model: torch.nn.Module, progress: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's model is, for people choosing one (`nmt serve`'s /models): its
    parameters, the step it was saved at and its best validation BLEU."""
    bleus = [r["bleu"] for r in progress.get("history", []) if r.get("bleu") is not None]
    return {
        "parameters": count_parameters(model),
        "step": progress.get("step"),
        "best_valid_bleu": max(bleus) if bleus else None,
    }


def checkpoint_of(path: Path) -> Path:
    """A checkpoint file, or the checkpoint that stands for a run directory
    (`RunDir.model_checkpoint`)."""
    path = Path(path)
    if path.is_dir():
        return RunDir(path).model_checkpoint()
    if not path.exists():
        raise NMTError(f"no such run directory or checkpoint: {path}")
    return path


def read_run(path: Path) -> tuple[Path, dict[str, Any], Config, Tokenizer]:
    """The checkpoint (of a run directory, or the file given), its payload, config and
    tokenizer: what `load_model` reads, without building the model or applying the
    process settings (the benchmarks' peers read a run this way)."""
    ckpt = checkpoint_of(path)
    payload = checkpoint.load(ckpt)
    tok_dir = RunDir.tokenizer_of(ckpt, payload.get("run_dir"))
    if not tok_dir.is_dir():
        raise NMTError(
            f"no tokenizer for {ckpt}: {tok_dir} does not exist; keep checkpoints in "
            "RUN_DIR/checkpoints/, beside the run's tokenizer/ folder"
        )
    return ckpt, payload, from_dict(payload["config"]), Tokenizer.from_dir(tok_dir)


_TRUE_FP32: set[Path] = set()  # checkpoints loaded on CUDA whose run asked for true fp32


def load_model(path: Path, device: torch.device) -> Loaded:
    """Model, config and tokenizer from a run directory or a checkpoint file, on `device`
    (with the process settings for it, `configure_device`: on CUDA fp32 products on
    TensorFloat-32 units as the run's train.tf32 says, as it trained and validated; the
    setting is the process', so once a model that asks for true fp32 is loaded, every model
    the process decodes gets it: an ensemble's, a server's)."""
    if device.type != "cuda":
        configure_device(device)  # the host's settings, before the checkpoint is read
    ckpt, payload, cfg, tokenizer = read_run(path)
    if device.type == "cuda":
        if not cfg.train.tf32:
            _TRUE_FP32.add(Path(ckpt))
        configure_device(device, tf32=not _TRUE_FP32)
    model = build_model(payload["arch"], cfg.model, Vocab(**payload["vocab"]))
    model.load_state_dict(payload["model"])
    model.to(device).eval()
    run_dir = RunDir.tokenizer_of(ckpt, payload.get("run_dir")).parent
    return Loaded(model, cfg, tokenizer, run_dir, ckpt, payload)


def load_models(paths: list[Path], device: torch.device) -> Loaded:
    """One run's model, or for several runs an `Ensemble` of theirs (the mean of their
    log-probabilities at each step), with the first run's config, decode settings and
    tokenizer. Ensembled runs must share the tokenizer and the languages: a difference is
    refused, named."""
    loaded = [load_model(p, device) for p in paths]
    if len(loaded) == 1:
        return loaded[0]
    first = loaded[0]
    for path, other in zip(paths[1:], loaded[1:]):
        why = tokenizer_difference(first, other)
        if why:
            raise NMTError(
                f"cannot ensemble {path} with {paths[0]}: {why}; ensembled runs need one tokenizer"
            )
    ensemble = Ensemble([m.model for m in loaded]).to(device).eval()
    return Loaded(
        ensemble,
        first.config,
        first.tokenizer,
        first.run_dir,
        first.checkpoint,
        first.payload,
        loaded,
    )


def tokenizer_difference(a: Loaded, b: Loaded) -> str:
    """How two runs' vocabularies differ ('' when they are one)."""
    da, db = a.config.data, b.config.data
    if (da.src, da.tgt) != (db.src, db.tgt):
        return f"it translates {db.src}->{db.tgt}, not {da.src}->{da.tgt}"
    if a.tokenizer.joint != b.tokenizer.joint:
        kinds = {True: "a joint", False: "separate"}
        return f"it has {kinds[b.tokenizer.joint]} vocabulary, not {kinds[a.tokenizer.joint]} one"
    va, vb = a.payload["vocab"], b.payload["vocab"]
    if (va["src_size"], va["tgt_size"]) != (vb["src_size"], vb["tgt_size"]):
        return f"its vocabulary has {vb['tgt_size']:,} pieces, not {va['tgt_size']:,}"
    if any(x.read_bytes() != y.read_bytes() for x, y in zip(a.tokenizer.files, b.tokenizer.files)):
        return "its sentencepiece model has other pieces (another tokenizer training)"
    return ""


def search_options(
    d: DecodeConfig,
    *,
    beam: int | None = None,
    nbest: int | None = None,
    sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    fixed_len: int | None = None,
) -> SearchOptions:
    """The search settings of decode section `d`, with `beam` and `nbest` when given, and
    sampling (`sample`, `temperature`, `top_k`, `top_p`, `seed`) or a fixed output length
    (benchmarks). Values a search cannot honour are refused (`NMTError`)."""
    opts = SearchOptions(
        beam=d.beam if beam is None else beam,
        nbest=d.nbest if nbest is None else nbest,
        length_penalty=d.length_penalty,
        length_norm=d.length_norm,
        max_len_a=d.max_len_a,
        max_len_b=d.max_len_b,
        min_len=d.min_len,
        no_repeat_ngram=d.no_repeat_ngram,
        ban_unk=d.ban_unk,
        sample=sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        fixed_len=fixed_len,
        patience=d.patience,
    )
    quota = ends_after(opts)
    for ok, problem in (
        (opts.beam >= 1, f"the beam size must be >= 1 (got {opts.beam})"),
        (
            0 < opts.temperature < math.inf,
            f"--temperature must be > 0 and finite (got {opts.temperature})",
        ),
        (
            -(2**63) <= opts.seed < 2**64,
            f"--seed must be in [-2^63, 2^64), a generator's range (got {opts.seed})",
        ),
        (0 < opts.top_p <= 1, f"--top-p must be in (0, 1] (got {opts.top_p})"),
        (opts.top_k >= 0, f"--top-k must be >= 0, 0 = no top-k filter (got {opts.top_k})"),
        (
            quota is None or opts.beam == 1 or quota >= opts.nbest,
            f"with beam {opts.beam} and patience {opts.patience} a sentence ends after {quota} "
            f"finished hypotheses, fewer than the n-best {opts.nbest}: raise --patience",
        ),
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


def worker_threads(workers: int) -> int:
    """Each of `workers` decoding workers' share of the calling thread's torch threads."""
    return max(1, torch.get_num_threads() // workers)


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to n for the scope (threads started in it use n)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# A decoder of whole batches elsewhere (another process): helper(src, opts, stop) returns what
# `decode_batch` returns for src (raising SearchStopped once `stop` is set), or raises
# `HelperUnavailable` (`map_in_workers`)
Helper = Callable[[Tensor, SearchOptions, threading.Event], list[list[Hypothesis]]]


class HelperUnavailable(Exception):
    """A helper cannot decode (its process could not start, or ended): the batch it was
    given is decoded by the thread that called it, and so are that thread's next ones."""


def map_in_workers(
    fn: Callable[[Any], Any],
    items: list,
    workers: int,
    done: Callable[[Any], None] | None = None,
    stop: threading.Event | None = None,
    helpers: list[Callable[[Any], Any]] | None = None,
    cost: Callable[[Any], Any] | None = None,
) -> list:
    """[fn(x) for x in items], `workers` items at once in threads that split torch's intra-op
    threads between them (one at a time for 1); done(x) after each result, in item order.
    With `cost` and several workers, the items start costliest first (ties in item order),
    and done(x) follows that order: the workers end on cheap items rather than one waiting
    at the end for another's long one (the longest-processing-time-first rule; CTranslate2
    starts its batches longest first). The results are in item order either way.
    With `helpers` (at most workers - 1 are used), a thread that takes a helper at its first
    item calls helper(x) instead of fn(x) for all its items (fn(x) once the helper raises
    `HelperUnavailable`); the items go to whichever thread is free, so a helper that is slow
    to start takes fewer.
    On an error or Ctrl-C the items not started are dropped, and `stop` is set (as soon as
    any item fails, whichever) before the running ones are waited for: an fn that watches it
    (a search does, at every step) ends early, so Ctrl-C stops a decode at once instead of
    after the batches in flight (~1 s). The first error an item raised is raised, not the
    stops it caused in the others."""
    spare: queue.SimpleQueue = queue.SimpleQueue()  # helpers no thread has taken yet
    for helper in (helpers or [])[: max(0, workers - 1)]:
        spare.put(helper)
    mine = threading.local()  # a thread's helper, None for none

    def work(x: Any) -> Any:
        if not hasattr(mine, "helper"):
            try:
                mine.helper = spare.get_nowait()
            except queue.Empty:
                mine.helper = None
        if mine.helper is not None:
            try:
                return mine.helper(x)
            except HelperUnavailable:
                mine.helper = None
        return fn(x)

    if workers == 1:
        results = []
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

    order = list(range(len(items)))
    if cost is not None:
        order.sort(key=lambda i: cost(items[i]), reverse=True)  # stable: ties in item order
    with intra_op_threads(worker_threads(workers)):
        pool = ThreadPoolExecutor(workers, thread_name_prefix="nmt-decode")
        futures = {i: pool.submit(work, items[i]) for i in order}  # started in this order
        for future in futures.values():
            future.add_done_callback(on_done)
        out: list = [None] * len(items)
        try:
            for i, future in futures.items():
                try:
                    out[i] = future.result()
                except Exception as e:
                    raise (failed[0] if failed else e) from None
                if done:
                    done(items[i])
        except BaseException:
            if stop is not None:
                stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return out


def decode_batch(
    model: torch.nn.Module,
    src: Tensor,
    opts: SearchOptions,
    device: torch.device,
    precision: str,
    stop: threading.Event | None = None,
) -> list[list[Hypothesis]]:
    """Search one batch src[B,S] (EOS-terminated, PAD-padded) in `precision` on `device`."""
    src = src.to(device)
    with autocast(device, precision):  # thread-local, as is search's inference mode
        return search(model, src, source_mask(src), opts, stop)


def decode_batches(
    model: torch.nn.Module,
    batches: list[Tensor],
    opts: SearchOptions,
    device: torch.device,
    precision: str,
    workers: int = 0,
    progress: Callable[[int], None] | None = None,
    helpers: list[Helper] | None = None,
) -> list[list[list[Hypothesis]]]:
    """Search every batch src[B,S] (EOS-terminated, PAD-padded); results in batch order.

    On CPU, `workers` batches (`decode_workers`) are decoded at once by threads that share the
    cores (`map_in_workers`: 2 threads give 2 workers x 1). Most of a decoding step that is
    not a matrix product (softmax, top-k, cache copies, Python) runs on one core while the
    other waits; two batches in flight keep both busy. Beam 5 on the Multi30k-sized
    transformer, 2 cores, 1,024 sentences in batches of 64, in one process: 1 worker x 2
    threads 110-113 sentences/s in fp32, 152-165 in bf16; 2 workers x 1 thread 122-126 and
    196-198, the same outputs (3 workers: 116-123 / 190-196). Each batch is searched as it
    would be alone; the weights are packed once for all of them. With `helpers` (decoders
    in other processes: `nmt.decode_process.helping`), all but one of the workers hand
    their batches to a helper each, so that only one search takes turns at this process'
    interpreter lock. The batches start longest first (`source_width`): ending on short
    ones, the workers end together. The 1,000 test sentences in batches of 64 (int8, 2
    workers, one a helper), four pairs of passes alternating: 251-271 sentences/s shortest
    first, the workers idle 0.31-0.50 s in all at the end; 267-287 longest first, 0.02-0.07 s,
    the same outputs. `nmt translate`'s batches of a token budget: the same speed either way.
    """
    model.eval()
    stop = threading.Event()  # set on an error or Ctrl-C: the batches in flight end early

    def run(src: Tensor) -> list[list[Hypothesis]]:
        return decode_batch(model, src, opts, device, precision, stop)

    done = (lambda src: progress(src.size(0))) if progress else None
    n_workers = decode_workers(workers, device, len(batches))
    threads = worker_threads(n_workers)
    log.debug(
        "decoding %d batch(es) on %s in %s, %d at once, %d thread(s) each, %d in helpers",
        len(batches),
        device,
        precision,
        n_workers,
        threads,
        min(len(helpers or ()), n_workers - 1),
    )
    # a helper searches with these options and stops with the others (map_in_workers calls
    # helper(src))
    bound = [functools.partial(helper, opts=opts, stop=stop) for helper in helpers or ()]
    with fixed_weights(model):  # the longest sources first (`map_in_workers`)
        return map_in_workers(run, batches, n_workers, done, stop, bound, source_width)


def source_width(src: Tensor) -> int:
    """Source positions of a batch src[B,S] (its longest source, padded): the cost by which
    `decode_batches` orders its batches, longest first."""
    return src.size(1)


def source_batch(sources: list[list[int]]) -> Tensor:
    """Token-id sources (without EOS) as src[B,S]: each ended by EOS, PAD after it."""
    width = max(len(s) for s in sources) + 1
    # one tensor from lists (a batch of 64 in 0.14 ms; row by row into a tensor took 0.74 ms)
    rows = [[*ids, EOS_ID, *[PAD_ID] * (width - len(ids) - 1)] for ids in sources]
    return torch.tensor(rows, dtype=torch.long)


def source_mask(src: Tensor) -> Tensor:
    """src_mask[B,S] of a source batch: True at real tokens (EOS included), as batching
    makes it for training."""
    return src != PAD_ID


def decode_ids(
    model: torch.nn.Module,
    sources: list[list[int]],
    opts: SearchOptions,
    batch_tokens: int,
    device: torch.device,
    precision: str,
    progress: Callable[[int], None] | None = None,
    workers: int = 0,
    helpers: list[Helper] | None = None,
) -> list[list[Hypothesis]]:
    """Decode token-id sources (without EOS) in length-sorted batches of at most
    `batch_tokens` source positions x beam; results in input order."""
    lengths = np.array([len(s) + 1 for s in sources])
    order = np.argsort(lengths, kind="stable")
    groups = pack(order, lengths * opts.beam, batch_tokens)
    batches = [source_batch([sources[i] for i in idx]) for idx in groups]
    results: list[list[Hypothesis]] = [[] for _ in sources]
    decoded = decode_batches(model, batches, opts, device, precision, workers, progress, helpers)
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
    helpers: list[Helper] | None = None,
) -> list[list[tuple[str, Hypothesis]]]:
    """n-best (text, hypothesis) per input line; empty lines give an empty list. `helpers`:
    see `decode_batches`."""
    todo, ids = to_translate(lines, tokenizer.encode_src)
    hyps = decode_ids(model, ids, opts, batch_tokens, device, precision, progress, workers, helpers)
    out: list[list[tuple[str, Hypothesis]]] = [[] for _ in lines]
    for i, nbest in zip(todo, hyps):
        texts = tokenizer.decode_tgt([h.tokens for h in nbest])
        out[i] = list(zip(texts, nbest))
    return out


def to_translate(
    lines: list[str], encode: Callable[[list[str]], list[list]]
) -> tuple[list[int], list]:
    """The indices of the lines that hold something to translate, and `encode`'s encodings of
    them (stripped). A line of spaces, or of characters the tokenizer drops (a zero-width
    space), holds nothing: it translates to an empty line, whatever the engine (a model given
    no source piece still wrote a sentence, where CTranslate2 wrote none)."""
    stripped = [line.strip() for line in lines]
    todo = [i for i, line in enumerate(stripped) if line]
    kept = [(i, e) for i, e in zip(todo, encode([stripped[i] for i in todo])) if e]
    return [i for i, _ in kept], [e for _, e in kept]


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


@dataclass
class Attention:
    """Where one translation looked: weights[T,S] (target tokens and EOS x source pieces and
    EOS) with the pieces that label them."""

    weights: np.ndarray
    src_pieces: list[str]
    tgt_pieces: list[str]


def attention_of(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    sentence: str,
    tokens: list[int],
    device: torch.device,
    precision: str,
) -> Attention | None:
    """The model's attention while it scores translation `tokens` of `sentence` (forced
    decoding, the source built and masked as for decoding); None for a model without
    attention."""
    src = source_batch(tokenizer.encode_src([sentence])).to(device)
    with autocast(device, precision):
        _, attention = force_decode(model, src, source_mask(src), tokens)
    if attention is None:
        return None
    return Attention(
        attention.float().cpu().numpy(),
        tokenizer.src_pieces(sentence) + ["</s>"],
        tokenizer.tgt_pieces(tokens) + ["</s>"],
    )
