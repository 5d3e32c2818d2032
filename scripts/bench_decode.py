"""Decoding speed: sentences/s on the 1,000 test_2016_flickr sources, greedy and beam search,
fp32, bf16 autocast and int8 linear maps, for each architecture; side by side with Hugging
Face `generate()` and CTranslate2 on a MarianMTModel of the transformer recipe's size when
they are installed.

What is measured
  * Models: each trained run given with --run DIR (repeatable; its best/last checkpoint, its
    tokenizer and prepared data), or, without --run, randomly initialised models at the sizes of
    recipes/multi30k/{seq2seq,rnn_attention,transformer}.yaml (--archs). In fixed-length mode
    decoding speed does not depend on the weights.
  * Sources: the prepared test_2016_flickr split (--split), token ids + EOS, sorted by length
    (stable) and cut into batches of --batch-size sentences (default 64), built once before
    timing; every system decodes the same batches.
  * nmt: `nmt.translate.decode_batches` (what `nmt translate` runs on its batches) with the
    run's (or recipe's) decode settings (a run's beam search also with CTranslate2's: --search
    below), beam --beam (default 5) or greedy, in each of --precisions (default fp32, bf16
    where the CPU has native bf16, int8 where torch runs its fbgemm int8 kernels: `nmt
    translate --precision int8`; the ratio table sets each against CTranslate2 of its
    precision, or fp32, and against CTranslate2 int8).
    It decodes --workers batches at once (default 0 = auto, as `nmt translate`: 2 workers of
    1 intra-op thread each on 2 threads), in inference mode, on the model's weights packed
    for oneDNN. Like `nmt translate`, which packs them once per input, the benchmark packs
    them once (~9 ms for the transformer, during warm-up), not once per batch. A run's rows
    with 2 or more workers decode as `nmt translate` decodes 2,000 lines or more at beam 5 (lines x
    beam >= 10,000): all but one
    worker's batches in child processes that loaded the run (`nmt.decode_process.helping`,
    started during the warm-up; column "procs"); --helpers off keeps every worker in threads.
  * --compile on|both (a run's fp32 and bf16 rows): nmt decodes through torch.compile'd code,
    as `nmt serve --compile` does (`nmt.engine.compile_decoding`), each row on its own
    compiled copy of the run; its child processes compile theirs before their first batch. A
    whole untimed pass compiles first; a graph compiled during the timed passes is counted in
    the row ("graphs_compiled_while_timed") and noted. "both" times each nmt row eagerly and
    compiled, in the same rounds (column "compiled").
  * --fixed-len N (SearchOptions.fixed_len): every sentence gets exactly N tokens (EOS forbidden
    before), so all systems do identical work whatever the weights. Default N = 20 without
    --run; with --run the default is free decoding (--fixed-len 0), which stops at EOS.
    nmt then runs N + 1 decoder steps (N tokens, then the forced EOS is scored). With
    --match steps (default) HF and CTranslate2 are asked for N + 1 new tokens so every system
    runs the same number of decoder steps; --match tokens asks them for N.
  * Hugging Face: MarianMTModel of the same size (d_model 256, 3+3 layers, 4 heads, FFN 1024,
    joint vocabulary, tied embeddings, max 256 positions, SDPA), random weights,
    generate(num_beams=beam or 1, do_sample=False, min_new_tokens = max_new_tokens), same
    batches, fp32 and bf16 autocast. Fixed-length mode only (random weights). With
    --peer-workers 1 2 it is also run 2 batches at once, in threads splitting the intra-op
    threads as nmt's workers do (a row per value; ratios are given for each).
  * CTranslate2: that Marian model saved to a temporary directory and converted with
    ctranslate2.converters.TransformersConverter (the tokenizer it reads is replaced by our
    sentencepiece vocabulary; the model gets one extra vocabulary row, which the Marian converter
    removes as Marian's <pad>), Translator(inter_threads = W from --peer-workers, intra_threads =
    --threads / W), one translate_batch call per pass (source token strings from our tokenizer
    + </s>, beam_size, min_decoding_length = max_decoding_length, max_batch_size =
    --batch-size: CTranslate2 sorts by length and cuts batches of that size, as we do, and runs
    them on its W workers). Compute types: float32, and bfloat16 only where CTranslate2
    supports it on this CPU (it is skipped with a note otherwise), and int8 and int8_float32
    weights where it supports them (int8 computes in int8 with the fastest float type, int8_float32
    in int8 with fp32 elsewhere).
  * The trained run in CTranslate2 (--run, free decoding; --run-ct2 off skips it): each run's
    model exported with `nmt.export` (kept in RUN/exports/, as `--engine ctranslate2` keeps it)
    in every compute type CTranslate2 supports on this CPU among float32, bfloat16, int8,
    int8_float32 and int8_bfloat16, decoded through `nmt.engine.CT2Engine` (what `nmt translate
    --engine ctranslate2` runs: nmt's length limit per sentence, its beam, n-best 1, PAD and BOS
    never generated) on the same sentences, beam --beam or greedy, length_norm plain (CTranslate2
    normalises by |y| ** alpha), CTranslate2 batches of about
    --batch-size sentences (batch_tokens = batch size x mean source length x beam),
    inter_threads = W from --peer-workers, intra_threads = --threads / W. These rows are peers:
    they run under both process settings (--peer-host) and a second table gives nmt's speed over
    its own model's CTranslate2 speed.
  * The search of a run's nmt rows (--search): "run", the run's decode settings (nmt translate's
    default: with patience null the exact stopping rule, which decodes a sentence until no live
    hypothesis can beat its K-th finished one); "ct2", the search its CTranslate2 rows run
    (`nmt.engine.ct2_search`: length_norm plain, patience 1 where the run's is null, the rule
    CTranslate2 and fairseq stop by), so that nmt and CTranslate2 do the same work; "both"
    (default). Greedy search is the same search either way: its rows say "run". The table of
    nmt against its own model's CTranslate2 sets every CTranslate2 row against the nmt rows of
    each search.
  * --profile BATCHES: after nmt's timed passes, BATCHES batches decoded one at a time (in the
    timing thread, with --threads intra-op threads) under torch.profiler: each operator's own
    time summed by kind (matrix products, casts, softmax, search: top-k and reordering,
    elementwise, other) and the longest operators, per batch and as a share of all operators'
    time; what no operator accounts for is Python's (and the profiler's) share
    (`_benchutil.profile_ops`).
  * Process settings (--peer-host): nmt runs under the settings `nmt translate` applies
    (`nmt.device.configure_host`: denormals flushed, and glibc malloc keeps freed memory: no
    mmap per large tensor, no trimming, a 64 MB top pad). Those settings speed up HF
    generate() too: beam 5 in fp32 went from 49.4 to 66.6 sentences/s with them (the malloc
    part; flushing denormals changed nothing). So the peers are measured twice (default
    "both"): in this process under nmt's settings (host "nmt", the strict comparison), and in
    a child process that keeps the library defaults, as a user of HF or CTranslate2 runs
    them (host "default"). The ratio table has a row for each.
  * Timing: every row of this process is set up and runs its --warmup untimed batches per
    worker first; then --repeats rounds, each timing one full pass over all batches of every
    row in turn (time.perf_counter), so that a drift of the machine's speed during the run
    (10-15% within minutes on a shared VM) falls on all rows alike instead of on whichever
    row ran then; sentences/s of the median pass (min and max in the JSON). The peers under
    their default settings (--peer-host) run in their own process after this one's rows.

Commands:
  NMT_DATA_DIR=../shared/data \\
      python scripts/bench_decode.py --json runs/bench_decode.json
  # trained runs, free decoding and fixed length:
  ... scripts/bench_decode.py --run runs/multi30k_transformer --run runs/multi30k_rnn_attention
  ... scripts/bench_decode.py --run runs/multi30k_transformer --fixed-len 20
  # a trained run next to its own CTranslate2 exports (int8, int8_float32, float32, ...), nmt's
  # beam rows with the run's search and with CTranslate2's:
  ... scripts/bench_decode.py --run runs/multi30k_transformer --modes greedy beam
  # where beam search's time goes, bf16, 4 batches of 64 (peers off):
  ... scripts/bench_decode.py --archs transformer --modes beam --precisions bf16 --hf off \\
      --ct2 off --profile 4
  # peers under nmt's process settings only (one process, no child):
  ... scripts/bench_decode.py --peer-host nmt
  # smoke test (128 sentences, 6 tokens unless --fixed-len is given; under a minute with
  # the peers, whose second process converts the CTranslate2 model again):
  ... scripts/bench_decode.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

MODES = ("greedy", "beam")
COMPILED = {"off": (False,), "on": (True,), "both": (False, True)}  # --compile's nmt rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", default=[], help="trained run dir (repeatable)")
    p.add_argument(
        "--archs", nargs="+", default=list(bu.ARCHS), choices=bu.ARCHS, help="without --run"
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--precisions", nargs="+", default=None, choices=bu.DECODE_PRECISIONS)
    p.add_argument(
        "--fixed-len", type=int, default=None, help="N output tokens (0 = free decoding)"
    )
    p.add_argument("--match", choices=("steps", "tokens"), default="steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over all batches")
    p.add_argument("--hf", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--ct2", choices=("auto", "on", "off"), default="auto")
    p.add_argument(
        "--run-ct2",
        choices=("auto", "off"),
        default="auto",
        help="--run models exported to CTranslate2 (auto: when ctranslate2 is importable)",
    )
    p.add_argument(
        "--search",
        choices=("run", "ct2", "both"),
        default="both",
        help="a run's nmt beam rows: its decode settings, the search its CTranslate2 rows run "
        "(length_norm plain, patience 1 where null), or both (default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="nmt: batches decoded at once (decode.workers; 0 = auto, as nmt translate)",
    )
    p.add_argument(
        "--helpers",
        choices=("auto", "off"),
        default="auto",
        help="a run's nmt rows with 2 or more workers: all but one worker's batches in child "
        "processes, as nmt translate decodes 2,000 lines or more at beam 5 (auto), or threads only "
        "(off)",
    )
    p.add_argument(
        "--compile",
        choices=("off", "on", "both"),
        default="off",
        help="a run's fp32 and bf16 nmt rows decode through torch.compile'd code as `nmt serve "
        "--compile`'s do (on), eagerly (off), or each row both ways, timed in the same rounds "
        "(both); a compiled row runs on its own compiled copy of the run's model, after a "
        "whole untimed pass that compiles (minutes)",
    )
    p.add_argument(
        "--peer-workers",
        type=int,
        nargs="+",
        default=[1],
        help="HF and CTranslate2: batches decoded at once, each value a row (default 1)",
    )
    p.add_argument(
        "--peer-host",
        choices=("nmt", "default", "both"),
        default="both",
        help="process settings HF and CTranslate2 run under: nmt's (in this process), the "
        "library defaults (in a child process), or both (default)",
    )
    p.add_argument("--peers-only", action="store_true", help=argparse.SUPPRESS)  # the child
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="BATCHES",
        help="after timing, profile nmt decoding BATCHES batches one at a time: operator time "
        "by kind",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 128 sentences, 6 tokens")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.precisions = args.precisions or bu.default_precisions(decoding=True)
    if args.fixed_len is None:
        args.fixed_len = 0 if args.run else (6 if args.quick else 20)
    if args.compile != "off" and not args.run:
        p.error("--compile compiles a trained run's decoding: give --run")
    if args.quick:
        args.limit = args.limit or 128
        args.repeats, args.warmup = 1, 1
    if args.hf == "on" and not bu.hf_available():
        p.error("--hf on: transformers is not importable in this Python")
    if args.ct2 == "on":
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            p.error("--ct2 on: ctranslate2 is not importable in this Python")
    return args


@dataclass
class Subject:
    name: str
    arch: str
    model: Any
    cfg: Any
    tokenizer: Any
    sources: list[list[int]]
    texts: list[str]
    run: str | None = None  # the run directory (--run), None for random-init models


def load_subjects(args) -> list[Subject]:
    """The models to time and their sources. The peers' child process (--peers-only) needs
    only the tokenizers and sources: it builds no model and does not call `load_model`,
    which applies nmt's process settings (`configure_host`)."""
    from nmt.data.prepare import prepare
    from nmt.models.registry import build_model
    from nmt.translate import load_model, read_run

    subjects = []
    if args.run:
        for run in args.run:
            if args.peers_only:
                _, payload, cfg, tokenizer = read_run(Path(run))
                model = None
            else:
                loaded = load_model(Path(run), torch.device("cpu"))
                payload, cfg, model = loaded.payload, loaded.config, loaded.model
                tokenizer = loaded.tokenizer
            split = prepare(cfg).split(args.split)
            n = min(args.limit or len(split), len(split))
            subjects.append(
                Subject(
                    name=Path(run).name,
                    arch=payload["arch"],
                    model=model,
                    cfg=cfg,
                    tokenizer=tokenizer,
                    sources=[split.src_ids(i).tolist() for i in range(n)],
                    texts=split.texts("src")[:n],
                    run=run,
                )
            )
        return subjects
    for arch in args.archs:
        cfg = bu.load_recipe(arch)
        prepared = prepare(cfg)
        split = prepared.split(args.split)
        n = min(args.limit or len(split), len(split))
        torch.manual_seed(args.seed)
        model = None
        if not args.peers_only:
            model = build_model(arch, cfg.model, bu.vocab_of(prepared)).eval()
        subjects.append(
            Subject(
                name=f"{arch} (random init)",
                arch=arch,
                model=model,
                cfg=cfg,
                tokenizer=prepared.tokenizer(),
                sources=[split.src_ids(i).tolist() for i in range(n)],
                texts=split.texts("src")[:n],
            )
        )
    return subjects


def make_batches(
    sources: list[list[int]], batch_size: int
) -> list[tuple[np.ndarray, torch.Tensor]]:
    """Length-sorted batches of `batch_size` sentences: (indices, src ids + EOS, right-padded)."""
    from nmt.translate import source_batch

    lengths = np.array([len(s) + 1 for s in sources])
    order = np.argsort(lengths, kind="stable")
    batches = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batches.append((idx, source_batch([sources[i] for i in idx])))
    return batches


# A row's timing is a generator (`timed_passes`, through the `bench_*` functions): it warms up
# when first advanced, then yields each of its --repeats passes for `in_rounds` to time, and
# returns the row.
Bench = Generator[Callable[[], list], tuple[float, list], dict]


def timed_passes(
    decode_pass, batches: list, args, workers: int, whole: bool = False
) -> Generator[Callable[[], list], tuple[float, list], tuple[list[float], list]]:
    """--warmup untimed batches per worker (a whole pass with `whole`: compiled decoding's
    warm-up compiles every graph the passes need), then --repeats passes of decode_pass over
    all batches, each yielded to be timed (`in_rounds` sends back its seconds and outputs);
    returns the times and the outputs of the last pass."""
    decode_pass(batches if whole else batches[: args.warmup * workers])
    times, outputs = [], []
    for _ in range(args.repeats):
        seconds, outputs = yield lambda: decode_pass(batches)
        times.append(seconds)
    return times, outputs


def in_rounds(benches: list[Bench], threads: int) -> list[dict]:
    """The rows of `benches`, their passes timed in rounds: every row set up and warmed up
    first, then in each round one pass of every row, in turn. A machine whose speed drifts
    during the run (a shared VM drifts by 10-15% within minutes) slows every row alike,
    where rows timed one after the other would each meet another speed. Each pass starts
    with torch at `threads` intra-op threads (creating a CTranslate2 translator sets them
    to 1 in its thread)."""
    rows: list[dict | None] = [None] * len(benches)
    waiting = []
    for i, bench in enumerate(benches):
        try:
            waiting.append((i, bench, next(bench)))
        except StopIteration as done:
            rows[i] = done.value
    while waiting:
        left = []
        for i, bench, decode in waiting:
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            outputs = decode()
            seconds = time.perf_counter() - t0
            try:
                left.append((i, bench, bench.send((seconds, outputs))))
            except StopIteration as done:
                rows[i] = done.value
        waiting = left
    return [row for row in rows if row is not None]


def in_workers(decode_batch, workers: int):
    """A pass function decoding `workers` batches (index, src) at once, as nmt's
    decode_batches does (the longest sources first)."""
    from nmt.translate import map_in_workers, source_width

    def cost(batch):
        return source_width(batch[1])

    return lambda batches: map_in_workers(decode_batch, batches, workers, cost=cost)


def row_of(
    system: str,
    name: str,
    mode: str,
    precision: str,
    workers: int,
    times: list[float],
    n: int,
    steps,
    out_len,
    host: str = "nmt",
    search: str = "run",
    compiled: bool = False,
) -> dict:
    med = bu.median(times)
    row = {
        "system": system,
        "model": name,
        "mode": mode,
        "precision": precision,
        "workers": workers,
        "host": host,
        "search": search,
        "compiled": compiled,
        "sentences": n,
        "decoder_steps": steps,
        "mean_output_tokens": out_len,
        "sentences_per_s": n / med,
        "sentences_per_s_min": n / max(times),
        "sentences_per_s_max": n / min(times),
        "pass_seconds": times,
    }
    where = "" if host == "nmt" else f" ({host} process settings)"
    if search != "run":
        where += f" ({search} search)"
    if compiled:
        where += " (compiled)"
    print(
        f"  {system} {name} {mode} {precision} x{workers}{where}: "
        f"{row['sentences_per_s']:,.1f} sent/s"
    )
    return row


def searches(subject: Subject, mode: str, args) -> list[str]:
    """The searches (--search) nmt decodes `subject` with in `mode`: the run's settings, and
    CTranslate2's for a trained run's beam search in free decoding (greedy search and
    fixed-length decoding are the same search in both)."""
    if not subject.run or mode != "beam" or args.fixed_len:
        return ["run"]
    return ["run", "ct2"] if args.search == "both" else [args.search]


def nmt_options(subject: Subject, mode: str, search: str, args):
    """The SearchOptions of an nmt row: the run's decode settings, or with search "ct2" the
    search CTranslate2 runs for them (`bench_ct2_run` asks it for length_norm plain)."""
    from nmt.engine import ct2_search
    from nmt.translate import search_options

    d = subject.cfg.decode
    if search == "ct2":
        d = dataclasses.replace(d, length_norm="plain")
    opts = search_options(
        d, beam=args.beam if mode == "beam" else 1, nbest=1, fixed_len=args.fixed_len or None
    )
    return ct2_search(opts) if search == "ct2" else opts


def compiled_rows(subject: Subject, precision: str, args, notes: list[str]) -> tuple[bool, ...]:
    """Whether each of a subject's nmt rows in `precision` decodes through compiled code
    (--compile): a run's fp32 and bf16 rows as asked; those `compile_decoding` refuses
    (`nmt.engine.compiles`: int8; a note says so once) and models without a run eagerly only."""
    from nmt.engine import compiles

    if not subject.run:
        return (False,)
    wanted = COMPILED[args.compile]
    if not compiles(precision) and True in wanted:
        note = f"nmt compiles fp32 and bf16 decoding, not {precision}: no compiled {precision} row"
        notes += [] if note in notes else [note]
        return tuple(c for c in wanted if not c)
    return wanted


def bench_nmt(
    subject: Subject, mode: str, precision: str, args, search: str = "run", compiled: bool = False
) -> Bench:
    from nmt.decode_process import helping
    from nmt.engine import compiled_graphs, open_engine
    from nmt.models.base import fixed_weights
    from nmt.translate import decode_batches, decode_workers

    opts = nmt_options(subject, mode, search, args)
    batches = make_batches(subject.sources, args.batch_size)
    device = torch.device("cpu")
    model = subject.model.eval()
    workers = decode_workers(args.workers, device, len(batches))
    with contextlib.ExitStack() as scope:
        helpers = []
        engine = None
        if compiled:  # a compiled copy of the run's model for this row alone
            engine = open_engine([Path(subject.run)], "nmt", device, precision, compile=True)
            model = engine.model
        if subject.run and args.helpers == "auto" and workers > 1:
            # as nmt translate decodes many lines: the child processes load the run (started
            # by the warm-up, which the timing leaves out, as it leaves out loading the peers;
            # with --compile they compile it before their first batch)
            engine = engine or open_engine([Path(subject.run)], "nmt", device, precision)
            n = len(subject.sources)
            helpers = scope.enter_context(helping(engine, n, opts, workers, workers - 1))

        def decode_pass(bs):
            srcs = [src for _, src in bs]
            return decode_batches(model, srcs, opts, device, precision, workers, None, helpers)

        graphs: list[int] = []  # compiled by this process in each pass, the warm-up's first

        def counted_pass(bs):
            before = compiled_graphs()
            try:
                return decode_pass(bs)
            finally:
                graphs.append(compiled_graphs() - before)

        with fixed_weights(model):
            times, outputs = yield from timed_passes(
                counted_pass, batches, args, workers, whole=compiled
            )
            late = sum(graphs[1:])  # during the timed passes
            profile = None
            if args.profile:  # one batch at a time, in this thread (and its intra-op threads)
                profile = bu.profile_ops(lambda b: decode_pass([b]), batches, args.profile, "batch")
    lengths = [len(h[0].tokens) if h else 0 for out in outputs for h in out]
    steps = args.fixed_len + 1 if args.fixed_len else None
    row = row_of(
        "nmt",
        subject.name,
        mode,
        precision,
        workers,
        times,
        len(subject.sources),
        steps,
        float(np.mean(lengths)),
        search=search,
        compiled=compiled,
    )
    row["worker_processes"] = 1 + sum(not h.gone for h in helpers)  # a child that failed: none
    if compiled:
        row["graphs_compiled_while_timed"] = late
        if late:
            print(f"  note: {late} graph(s) compiled during the timed passes, which they slowed")
    if profile:
        row["profile"] = profile
        bu.print_profile(f"nmt {subject.name} {mode} {precision}", profile)
    return row


def other_tokens(args) -> int:
    return args.fixed_len + 1 if args.match == "steps" else args.fixed_len


def bench_hf(model, subject: Subject, mode: str, precision: str, workers: int, args) -> Bench:
    from nmt.device import autocast

    new = other_tokens(args)
    batches = make_batches(subject.sources, args.batch_size)
    device = torch.device("cpu")
    kwargs = {
        "num_beams": args.beam if mode == "beam" else 1,
        "do_sample": False,
        "min_new_tokens": new,
        "max_new_tokens": new,
        "length_penalty": 1.0,
        "use_cache": True,
    }

    def decode(b):
        _, src = b
        with torch.no_grad(), autocast(device, precision):
            return model.generate(input_ids=src, attention_mask=(src != 0).long(), **kwargs)

    times, outputs = yield from timed_passes(in_workers(decode, workers), batches, args, workers)
    out_len = float(np.mean([o.size(1) - 1 for o in outputs]))  # minus the decoder start token
    return peer_row("hf-generate", mode, precision, workers, times, subject, new, out_len, args)


def convert_ct2(cfg, tokenizer, seed: int, workdir: Path) -> Path:
    """Save a same-size Marian model and convert it with CTranslate2's TransformersConverter."""
    from ctranslate2.converters import TransformersConverter

    size = tokenizer.tgt.get_piece_size()

    class Vocabulary:  # what the converter reads from a Hugging Face tokenizer
        eos_token, unk_token, bos_token = "</s>", "<unk>", "<s>"

        def get_vocab(self) -> dict[str, int]:
            return {tokenizer.tgt.id_to_piece(i): i for i in range(size)}

    class Converter(TransformersConverter):
        def load_tokenizer(self, *args, **kwargs):
            return Vocabulary()

    # One extra row: the Marian converter drops the last vocabulary row (Marian's own <pad>).
    model = bu.build_marian(cfg.model, size + 1, seed)
    model.save_pretrained(workdir / "hf")
    out = workdir / "ct2"
    Converter(str(workdir / "hf")).convert(str(out), force=True)
    return out


def bench_ct2(
    model_dir: Path, subject: Subject, mode: str, compute_type: str, workers: int, args
) -> Bench:
    import ctranslate2

    new = other_tokens(args)
    translator = ctranslate2.Translator(
        str(model_dir),
        device="cpu",
        compute_type=compute_type,
        intra_threads=max(1, args.threads // workers),
        inter_threads=workers,
    )
    pieces = [subject.tokenizer.src_pieces(t.strip()) + ["</s>"] for t in subject.texts]
    batches = [
        [pieces[i] for i in idx] for idx, _ in make_batches(subject.sources, args.batch_size)
    ]

    def decode_pass(bs):
        # One call: CTranslate2 runs the batches (of max_batch_size, length-sorted as ours)
        # on its inter_threads workers.
        results = translator.translate_batch(
            [p for b in bs for p in b],
            max_batch_size=args.batch_size,
            beam_size=args.beam if mode == "beam" else 1,
            min_decoding_length=new,
            max_decoding_length=new,
            length_penalty=1.0,
        )
        return [results]

    times, outputs = yield from timed_passes(decode_pass, batches, args, workers)
    out_len = float(np.mean([len(r.hypotheses[0]) for out in outputs for r in out]))
    precision = {"float32": "fp32", "bfloat16": "bf16"}.get(compute_type, compute_type)
    return peer_row("ctranslate2", mode, precision, workers, times, subject, new, out_len, args)


RUN_COMPUTE_TYPES = ("float32", "bfloat16", "int8", "int8_float32", "int8_bfloat16")
CT2_PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


def bench_ct2_run(subject: Subject, mode: str, compute_type: str, workers: int, args) -> Bench:
    """The trained run's own model in CTranslate2 (`compute_type`), through nmt's engine."""
    from nmt.engine import CT2Engine
    from nmt.translate import search_options

    engine = CT2Engine(Path(subject.run), compute_type, torch.device("cpu"))
    beam = args.beam if mode == "beam" else 1
    d = dataclasses.replace(subject.cfg.decode, length_norm="plain", nbest=1, beam=beam)
    opts = search_options(d, nbest=1)
    mean_len = float(np.mean([len(s) + 1 for s in subject.sources]))
    batch_tokens = max(16, round(args.batch_size * mean_len * beam))
    batches = [
        [subject.texts[i] for i in idx] for idx, _ in make_batches(subject.sources, args.batch_size)
    ]

    def decode_pass(bs):  # one call: CTranslate2 runs its batches on its workers
        return [engine.translate([t for b in bs for t in b], opts, batch_tokens, workers=workers)]

    times, outputs = yield from timed_passes(decode_pass, batches, args, workers)
    out_len = float(np.mean([len(n[0][1].tokens) if n else 0 for out in outputs for n in out]))
    precision = CT2_PRECISION.get(compute_type, compute_type)
    host = "default" if args.peers_only else "nmt"
    n = len(subject.sources)
    return row_of(
        "ctranslate2-run",
        subject.name,
        mode,
        precision,
        workers,
        times,
        n,
        None,
        out_len,
        host,
        "ct2" if mode == "beam" else "run",
    )


def peer_row(system: str, mode, precision, workers, times, subject, steps, out_len, args) -> dict:
    """A peer's row (its model: the Marian one), under this process' settings: nmt's, or the
    libraries' defaults in the --peers-only child (see --peer-host)."""
    host = "default" if args.peers_only else "nmt"
    n = len(subject.sources)
    return row_of(system, "marian", mode, precision, workers, times, n, steps, out_len, host)


def default_process_env() -> dict[str, str]:
    """This process' environment without nmt's allocator: glibc's malloc, as a user of HF or
    CTranslate2 runs them (the child inherited TCMalloc's LD_PRELOAD and ran on it)."""
    from nmt import allocator

    env = dict(os.environ)
    preloaded = env.pop(allocator.DONE, None)
    kept = [lib for lib in env.get("LD_PRELOAD", "").split(":") if lib and lib != preloaded]
    if kept:
        env["LD_PRELOAD"] = ":".join(kept)
    else:
        env.pop("LD_PRELOAD", None)
    env[allocator.CHOICE] = "system"
    return env


def peers_with_default_settings(argv: list[str], args) -> tuple[list[dict], list[str]]:
    """The peers' rows (and notes) from a child process (this script, --peers-only) that
    leaves the process settings at the libraries' defaults, glibc's malloc included. If it
    fails, no rows and a note: the rows measured so far are kept."""
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        out = Path(tmp) / "peers.json"
        extra = ["--peers-only", "--peer-host", "default", "--json", str(out)]
        extra += ["--precisions", *args.precisions]  # as decided here (no second note)
        sys.stdout.flush()  # the child writes to the same stdout
        sys.stderr.flush()
        child = [sys.executable, str(Path(__file__).resolve()), *argv, *extra]
        code = subprocess.run(child, env=default_process_env()).returncode
        if code != 0 or not out.exists():
            return [], [f"the peers' run with default process settings failed (exit {code})"]
        result = json.loads(out.read_text())
        return result["rows"], result["notes"]


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.peers_only:
        torch.set_num_threads(args.threads)  # and nothing else: the libraries' defaults
    else:
        bu.setup_torch(args.threads)
    bu.default_env()
    if not args.peers_only:  # the child starts right after the parent's own runs
        bu.warn_if_busy()
    machine = bu.machine_info()  # before the runs: CTranslate2 changes the thread count
    notes: list[str] = []
    subjects = load_subjects(args)
    scope = contextlib.ExitStack()  # what the rows need until they are timed (in_rounds)
    benches: list[Bench] = []
    for subject in [] if args.peers_only else subjects:
        for mode in args.modes:
            for precision in args.precisions:
                for search in searches(subject, mode, args):
                    for compiled in compiled_rows(subject, precision, args, notes):
                        benches.append(bench_nmt(subject, mode, precision, args, search, compiled))

    transformer = next((s for s in subjects if s.arch == "transformer"), subjects[0])
    use_hf = args.hf == "on" or (args.hf == "auto" and bu.hf_available())
    use_ct2 = args.ct2 != "off"
    if use_ct2 and args.ct2 == "auto":
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            use_ct2 = False
    if (use_hf or use_ct2) and not args.fixed_len:
        notes.append("HF and CTranslate2 run only in fixed-length mode (their models are random)")
        use_hf = use_ct2 = False
    if use_ct2 and not use_hf:
        use_ct2 = bu.hf_available()  # the conversion starts from a transformers model
    here = args.peers_only or args.peer_host != "default"  # peers in this process
    if use_hf and here:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        cfg = bu.load_recipe("transformer").model
        model = bu.build_marian(cfg, transformer.tokenizer.tgt.get_piece_size(), args.seed).eval()
        for mode in args.modes:
            for precision in [p for p in args.precisions if p in bu.PRECISIONS]:  # no HF int8
                for workers in args.peer_workers:
                    benches.append(bench_hf(model, transformer, mode, precision, workers, args))
    if use_ct2 and here:
        import ctranslate2

        supported = ctranslate2.get_supported_compute_types("cpu")
        wanted = {"fp32": "float32", "bf16": "bfloat16"}
        asked = [p for p in args.precisions if p in wanted]  # CTranslate2's int8: always
        types = [wanted[p] for p in asked if wanted[p] in supported]
        types += [t for t in ("int8", "int8_float32") if t in supported]
        for p in asked:
            if wanted[p] not in supported:
                notes.append(f"CTranslate2 {wanted[p]} is not supported on this CPU; skipped")
        tmp = scope.enter_context(tempfile.TemporaryDirectory(prefix="bench_ct2_"))
        model_dir = convert_ct2(
            bu.load_recipe("transformer"), transformer.tokenizer, args.seed, Path(tmp)
        )
        for mode in args.modes:
            for ct in types:
                for workers in args.peer_workers:
                    benches.append(bench_ct2(model_dir, transformer, mode, ct, workers, args))

    run_subjects = [s for s in subjects if s.run and s.arch == "transformer"]
    use_run_ct2 = args.run_ct2 != "off" and bool(run_subjects)
    if use_run_ct2:
        try:
            import ctranslate2
        except ImportError:
            use_run_ct2 = False
    if use_run_ct2 and args.fixed_len:
        notes.append("the runs' CTranslate2 rows need free decoding (--fixed-len 0); skipped")
        use_run_ct2 = False
    if use_run_ct2 and here:
        supported = ctranslate2.get_supported_compute_types("cpu")
        types = [t for t in RUN_COMPUTE_TYPES if t in supported]
        skipped = [t for t in RUN_COMPUTE_TYPES if t not in supported]
        if skipped and not args.peers_only:
            notes.append(f"CTranslate2 computes no {', '.join(skipped)} on this CPU; skipped")
        for subject in run_subjects:
            for mode in args.modes:
                for ct in types:
                    for workers in args.peer_workers:
                        benches.append(bench_ct2_run(subject, mode, ct, workers, args))

    with scope:
        rows = in_rounds(benches, args.threads)
        del benches
    gc.collect()
    if args.peers_only:  # the child: its rows go to the parent through --json
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes}, default=str))
        return {"rows": rows}
    if (use_hf or use_ct2 or use_run_ct2) and args.peer_host != "nmt":
        child_rows, child_notes = peers_with_default_settings(argv, args)
        rows += child_rows
        notes += [n for n in child_notes if n not in notes]

    ratios = []
    hosts = [h for h in ("nmt", "default") if args.peer_host in (h, "both")]
    for row in rows:
        # ratios for the (first) transformer only: the other systems are transformers
        if (
            row["system"] != "nmt"
            or row["model"] != transformer.name
            or transformer.arch != "transformer"
        ):
            continue
        for workers, host in [(w, h) for w in args.peer_workers for h in hosts]:
            entry = {
                "mode": row["mode"],
                "precision": row["precision"],
                "nmt": row["sentences_per_s"],
                "nmt_compiled": row["compiled"],
                "nmt_workers": row["workers"],
                "peer_workers": workers,
                "peer_host": host,
            }
            for system, key in (("hf-generate", "hf"), ("ctranslate2", "ct2")):
                same = [
                    r
                    for r in rows
                    if r["system"] == system
                    and r["mode"] == row["mode"]
                    and r["workers"] == workers
                    and r["host"] == host
                ]
                match = next((r for r in same if r["precision"] == row["precision"]), None)
                if match is None and system == "ctranslate2":
                    match = next((r for r in same if r["precision"] == "fp32"), None)
                if match:
                    entry[key] = match["sentences_per_s"]
                    entry[f"{key}_precision"] = match["precision"]
                    entry[f"nmt_over_{key}"] = row["sentences_per_s"] / match["sentences_per_s"]
                # CTranslate2's int8 is the production reference on CPU: every precision of
                # nmt against it
                int8 = None
                if system == "ctranslate2":
                    int8 = next((r for r in same if r["precision"] == "int8"), None)
                if int8:
                    entry["ct2_int8"] = int8["sentences_per_s"]
                    entry["nmt_over_ct2_int8"] = row["sentences_per_s"] / int8["sentences_per_s"]
            if any(key in entry for key in ("hf", "ct2", "ct2_int8")):  # a peer's figures
                ratios.append(entry)

    length = f"fixed length {args.fixed_len} tokens" if args.fixed_len else "free decoding (to EOS)"
    bu.print_table(
        rows,
        [
            ("system", "system"),
            ("model", "model"),
            ("mode", "mode"),
            ("precision", "prec"),
            ("workers", "workers"),
            ("worker_processes", "procs"),
            ("host", "settings"),
            ("search", "search"),
            ("compiled", "compiled"),
            ("sentences_per_s", "sent/s"),
            ("sentences_per_s_min", "min"),
            ("sentences_per_s_max", "max"),
            ("decoder_steps", "steps"),
            ("mean_output_tokens", "out tok"),
        ],
        title=f"decoding {len(transformer.sources)} {args.split} sentences, batch {args.batch_size}, "
        f"beam {args.beam}, {length}",
    )
    if ratios:
        bu.print_table(
            ratios,
            [
                ("mode", "mode"),
                ("precision", "prec"),
                ("nmt_compiled", "compiled"),
                ("nmt_workers", "nmt workers"),
                ("nmt", "nmt sent/s"),
                ("peer_workers", "peer workers"),
                ("peer_host", "peer settings"),
                ("hf", "HF sent/s"),
                ("nmt_over_hf", "nmt/HF"),
                ("ct2", "CT2 sent/s"),
                ("ct2_precision", "CT2 prec"),
                ("nmt_over_ct2", "nmt/CT2"),
                ("ct2_int8", "CT2 int8 sent/s"),
                ("nmt_over_ct2_int8", "nmt/CT2 int8"),
            ],
            title=f"nmt transformer ({transformer.name}) vs HF generate and CTranslate2 (same batches)",
        )
    own = []  # nmt's speed over its own model's in CTranslate2
    for row in rows:
        if row["system"] != "ctranslate2-run":
            continue
        for mine in rows:
            if (
                mine["system"] == "nmt"
                and mine["model"] == row["model"]
                and mine["mode"] == row["mode"]
            ):
                own.append(
                    {
                        "model": row["model"],
                        "mode": row["mode"],
                        "precision": mine["precision"],
                        "nmt": mine["sentences_per_s"],
                        "nmt_search": mine["search"],
                        "nmt_compiled": mine["compiled"],
                        "nmt_workers": mine["workers"],
                        "ct2_compute": row["precision"],
                        "ct2": row["sentences_per_s"],
                        "peer_workers": row["workers"],
                        "peer_host": row["host"],
                        "nmt_over_ct2": mine["sentences_per_s"] / row["sentences_per_s"],
                    }
                )
    if own:
        bu.print_table(
            own,
            [
                ("model", "model"),
                ("mode", "mode"),
                ("precision", "nmt prec"),
                ("nmt_search", "nmt search"),
                ("nmt_compiled", "compiled"),
                ("nmt_workers", "nmt workers"),
                ("nmt", "nmt sent/s"),
                ("ct2_compute", "CT2 compute"),
                ("peer_workers", "CT2 workers"),
                ("peer_host", "CT2 settings"),
                ("ct2", "CT2 sent/s"),
                ("nmt_over_ct2", "nmt/CT2"),
            ],
            title="nmt against its own model exported to CTranslate2 (nmt export, same sentences)",
        )
    for note in notes:
        print(f"note: {note}")
    result = {
        "benchmark": "bench_decode",
        "args": vars(args),
        "machine": machine,
        "notes": notes,
        "rows": rows,
        "ratios": ratios,
        "own_model_ratios": own,
    }
    bu.write_json(args.json, result)
    return result


if __name__ == "__main__":
    bu.on_nmts_allocator()
    main()
