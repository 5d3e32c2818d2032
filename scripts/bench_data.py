"""Data-pipeline throughput and memory at scale: `nmt prepare` on a 1,000,000-pair corpus.

What is run
  The Multi30k en-de training pairs ($NMT_DATA_DIR/multi30k/train.{en,de}.gz) repeated to
  --pairs lines are written as plain-text files train.en / train.de in a temporary directory
  (with the Multi30k validation pairs as val.en / val.de; no test split). Then
  `nmt.data.prepare.prepare(cfg)` runs on a config built with
  nmt.config.from_dict({"data": {source: text, train/valid prefixes, test: [], a fresh
  cache_dir}, "tokenizer": {vocab_size: --vocab-size}}): load, clean, train the joint
  sentencepiece tokenizer, encode, length-filter, save. Writing the input files is not timed.

What is reported
  * tokenizer training pairs/s = training pairs read / summary["seconds"]["tokenizer"];
  * encoding pairs/s = pairs encoded (training pairs after the empty-line filter + validation
    pairs) / summary["seconds"]["encode"];
  * prepare total pairs/s = training pairs read / summary["seconds"]["total"] (loading,
    cleaning, tokenizer, encoding, filtering and saving), and the wall time of prepare();
  * loading the prepared training split (Prepared.split: flat id arrays) in seconds;
  * batching pairs/s: TokenBatches(src_lens, tgt_lens, --batch-tokens, seed).all_batches(0) on
    all prepared training lengths, median of --repeats (time.perf_counter);
  * peak RSS: this process's VmHWM (/proc/self/status; equals ru_maxrss of RUSAGE_SELF) and,
    with --num-proc above 1, ru_maxrss of RUSAGE_CHILDREN (largest child), both in MiB, and
    their sum against the 2 GiB limit. A child started before prepare (ctypes' find_library
    forks ldconfig once torch is loaded) already counts there with this process' size at the
    fork: where prepare's workers stayed below it, their peak is reported as "at most" that.
    The process's peak includes the interpreter, torch and datasets imports.

Commands:
  NMT_DATA_DIR=../shared/data python scripts/bench_data.py \\
      --json runs/bench_data.json
  # smoke test (a few seconds):
  NMT_DATA_DIR=../shared/data python scripts/bench_data.py --quick
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

LIMIT_MIB = 2048


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=1_000_000, help="training pairs to write")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--batch-tokens", type=int, default=6000)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the batching")
    p.add_argument("--num-proc", type=int, default=1, help="data.num_proc")
    p.add_argument("--workdir", help="where to write the corpus and cache (default: temporary)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke test: 20,000 pairs")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.repeats = 20_000, 1
    return args


def read_gz(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def write_repeated(lines: list[str], n: int, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        full, rest = divmod(n, len(lines))
        block = "".join(line + "\n" for line in lines)
        for _ in range(full):
            f.write(block)
        f.write("".join(line + "\n" for line in lines[:rest]))


def children_peak_mib() -> float:
    """The largest peak resident size of this process' ended children (RUSAGE_CHILDREN)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bu.setup_torch(args.threads)
    bu.default_env()
    bu.warn_if_busy()
    import datasets

    from nmt.config import from_dict
    from nmt.data.batching import TokenBatches
    from nmt.data.prepare import prepare

    datasets.disable_progress_bars()
    corpus_dir = Path(os.environ["NMT_DATA_DIR"]) / "multi30k"
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_data_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        text = work / "corpus"
        text.mkdir(exist_ok=True)
        for lang in ("en", "de"):
            write_repeated(
                read_gz(corpus_dir / f"train.{lang}.gz"), args.pairs, text / f"train.{lang}"
            )
            val = read_gz(corpus_dir / f"val.{lang}.gz")
            write_repeated(val, len(val), text / f"val.{lang}")
        write_seconds = time.perf_counter() - t0
        cache = work / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        cfg = from_dict(
            {
                "data": {
                    "source": "text",
                    "src": "en",
                    "tgt": "de",
                    "train": str(text / "train"),
                    "valid": str(text / "val"),
                    "test": [],
                    "num_proc": args.num_proc,
                    "cache_dir": str(cache),
                },
                "tokenizer": {"vocab_size": args.vocab_size},
            }
        )
        print(f"wrote {args.pairs:,} pairs in {write_seconds:.1f}s; preparing ...")
        rss_before = vm_hwm_mib()
        # A child started before (find_library's ldconfig, forked from this process once torch
        # was loaded) already counts in RUSAGE_CHILDREN with this process' size at the fork.
        children_before = children_peak_mib()
        t0 = time.perf_counter()
        prepared = prepare(cfg)
        prepare_wall = time.perf_counter() - t0
        assert not prepared.reused, "the cache directory was not fresh"
        s = prepared.summary
        sec = s["seconds"]
        train_read = s["train_read"]
        encoded = train_read - s["dropped"]["empty"] + s["splits"]["valid"]["pairs"]

        t0 = time.perf_counter()
        split = prepared.split("train")
        load_seconds = time.perf_counter() - t0
        batches = TokenBatches(split.src_lens, split.tgt_lens, args.batch_tokens, 1234)
        times = bu.time_repeats(lambda: batches.all_batches(0), args.repeats, warmup=1)
        n_batches = len(batches.all_batches(0))
        n_train = len(split)

        self_mib = vm_hwm_mib()
        # prepare's own workers (num_proc > 1): their peak where it passed the earlier
        # children's; else at most that (reported as such, never a child of num_proc 1)
        children_after = children_peak_mib()
        children_exact = children_after > children_before
        children_mib = children_after if args.num_proc > 1 else 0.0
        peak = self_mib + children_mib
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    rows = [
        {"stage": "tokenizer training", "pairs": train_read, "seconds": sec["tokenizer"]},
        {"stage": "encoding (train + valid)", "pairs": encoded, "seconds": sec["encode"]},
        {"stage": "prepare total", "pairs": train_read, "seconds": sec["total"]},
        {"stage": "load prepared train split", "pairs": n_train, "seconds": load_seconds},
        {"stage": "batching (all_batches)", "pairs": n_train, "seconds": bu.median(times)},
    ]
    for row in rows:
        row["pairs_per_s"] = row["pairs"] / row["seconds"] if row["seconds"] else float("nan")
    bu.print_table(
        rows,
        [
            ("stage", "stage"),
            ("pairs", "pairs"),
            ("seconds", "seconds"),
            ("pairs_per_s", "pairs/s"),
        ],
        title=f"nmt prepare on {args.pairs:,} pairs (vocab {args.vocab_size}, "
        f"{n_batches:,} batches of {args.batch_tokens} tokens)",
    )
    print(
        f"\nprepare() wall time {prepare_wall:.1f}s; {s['dropped']} dropped; {n_train:,} training pairs kept"
    )
    print(
        f"peak RSS: process {self_mib:,.0f} MiB (before prepare {rss_before:,.0f} MiB) + children "
        f"{'' if children_exact or not children_mib else 'at most '}{children_mib:,.0f} MiB "
        f"= {peak:,.0f} MiB (limit {LIMIT_MIB} MiB): "
        f"{'OK' if peak < LIMIT_MIB else 'OVER LIMIT'}"
    )
    result = {
        "benchmark": "bench_data",
        "args": vars(args),
        "machine": bu.machine_info(),
        "summary": s,
        "prepare_wall_seconds": prepare_wall,
        "batching_seconds": times,
        "batches": n_batches,
        "rows": rows,
        "peak_rss_mib": {
            "self_vmhwm": self_mib,
            "self_before_prepare": rss_before,
            "children_max": children_mib,
            "children_max_exact": children_exact or not children_mib,
            "total": peak,
            "limit": LIMIT_MIB,
            "ok": peak < LIMIT_MIB,
        },
    }
    bu.write_json(args.json, result)
    return result


if __name__ == "__main__":
    bu.on_nmts_allocator()
    main()
