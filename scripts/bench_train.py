"""End-to-end training throughput of `nmt.train.train` and the share of step time spent
outside forward/backward/optimizer (data collation, scheduling, logging, bookkeeping).

What is run
  For each multi30k recipe (recipes/multi30k/{seq2seq,rnn_attention,transformer}.yaml) and each
  precision (fp32, bf16 autocast), the real trainer `nmt.train.train(cfg, run_dir)` (no
  reporter, like the CLI minus its progress bar) for --steps optimizer steps, with validation
  and checkpointing pushed out of the way: train.valid_bleu=false, train.valid_every and
  train.save_every = 10^9, train.max_minutes=null, train.log_every=--log-every. (The trainer
  still validates the loss and saves last.pt once when it stops, after the last log record, so
  outside the measured window.) Data: the prepared Multi30k data ($NMT_CACHE_DIR).

Throughput
  From RUN/metrics.jsonl: the train records after the first one (the first log interval is
  warm-up and excluded). tokens/s = sum(tokens_per_s_i * dt_i) / sum(dt_i) over those records,
  dt_i from the records' `minutes` (the trainer's wall clock), i.e. target tokens trained in the
  window / wall seconds of the window. The median of the records' own tokens_per_s is also shown.

Overhead (method: the trainer's own step timer)
  Each train record of metrics.jsonl carries `step_seconds`: the wall time the trainer spent in
  `nmt.train.train_step` during its log window (forward under autocast, loss, backward,
  clipping, optimizer step, zero_grad). overhead = 1 - (step seconds of the window's records) /
  (wall seconds of the window). Everything else in the loop counts as overhead: collating the
  next batch, the LR schedule, reading the step's numbers, the stop checks, writing
  metrics.jsonl. The optimizer's share comes from torch's public optimizer step hooks.
  Target: < 5%.
  With --pure, the same batches (reproduced from TokenBatches with the trainer's seed) are also
  trained in a plain loop (as bench_model does: pre-collated, fresh model with the trainer's
  seed) and overhead_pure = 1 - pure seconds / trainer seconds for the window's steps; this
  cross-check is noisier (two separate runs on shared cores).

Commands (needs the prepared Multi30k data):
  NMT_DATA_DIR=../shared/data \\
      python scripts/bench_train.py --steps 60 --json runs/bench_train.json
  # smoke test (a few seconds per run; tiny batches, numbers not meaningful):
  ... scripts/bench_train.py --quick
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

BIG = 10**9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", nargs="+", default=list(bu.ARCHS), choices=bu.ARCHS)
    p.add_argument("--precisions", nargs="+", default=None, choices=bu.PRECISIONS)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument(
        "--log-every", type=int, default=10, help="train.log_every (first interval = warm-up)"
    )
    p.add_argument("--batch-tokens", type=int, default=None, help="override train.batch_tokens")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra recipe override")
    p.add_argument("--pure", action="store_true", help="also time a plain loop on the same batches")
    p.add_argument("--out", help="directory for the run dirs (default: a temporary one, removed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke test: tiny batches, a few steps")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.precisions = args.precisions or bu.default_precisions()
    if args.quick:
        args.steps, args.log_every = 6, 2
        args.batch_tokens = args.batch_tokens or 600
    if args.steps < 2 * args.log_every:
        p.error("--steps must be at least 2 x --log-every (the first interval is warm-up)")
    return args


class OptimizerTimer:
    """Seconds in optimizer steps, through torch's public optimizer step hooks."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._handles: list = []
        self._t0 = 0.0

    def __enter__(self) -> OptimizerTimer:
        def pre(*_):
            self._t0 = time.perf_counter()

        def post(*_):
            self.seconds.append(time.perf_counter() - self._t0)

        self._handles = [
            register_optimizer_step_pre_hook(pre),
            register_optimizer_step_post_hook(post),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


def replay_batches(cfg, split, steps: int):
    """The trainer's first `steps` batches (one rank, accumulate=1), as index arrays."""
    from nmt.data.batching import TokenBatches

    batches = TokenBatches.of(split, cfg.train)  # the trainer's (batch_multiple too)
    out, epoch = [], 0
    while len(out) < steps:
        out.extend(batches.epoch(epoch))
        epoch += 1
    return out[:steps]


def pure_seconds(cfg, prepared, first: int, last: int, precision: str) -> float:
    """A plain loop over the trainer's batches first..last-1 (0-based) after training the earlier
    ones untimed, with the trainer's seed: compute only, batches collated beforehand."""
    from nmt.config import arch_of
    from nmt.distributed import seed_everything
    from nmt.models.registry import build_model

    split = prepared.split("train")
    order = replay_batches(cfg, split, last)
    seed_everything(cfg.train.seed)
    model = build_model(arch_of(cfg.model), cfg.model, bu.vocab_of(prepared))
    model.train()
    step = bu.nmt_train_step(model, bu.make_optimizer(model, cfg.train), cfg.train, precision)
    for idx in order[:first]:
        step(split.collate(idx))
    batches = [split.collate(idx) for idx in order[first:last]]
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    return time.perf_counter() - t0


def run_one(arch: str, precision: str, args, root: Path) -> dict:
    from nmt.data.prepare import prepare
    from nmt.run import RunDir, attach
    from nmt.train import train

    overrides = [
        f"train.precision={precision}",
        f"train.max_steps={args.steps}",
        "train.max_minutes=null",
        "train.max_epochs=null",
        "train.valid_bleu=false",
        f"train.valid_every={BIG}",
        f"train.save_every={BIG}",
        f"train.log_every={args.log_every}",
        "train.patience=null",
        "train.keep_last=0",
        "train.average_last=1",
        "train.accumulate=1",
        *([f"train.batch_tokens={args.batch_tokens}"] if args.batch_tokens else []),
        *args.sets,
    ]
    cfg = bu.load_recipe(arch, overrides)
    run_dir = root / f"{arch}_{precision}"
    shutil.rmtree(run_dir, ignore_errors=True)
    prepared = prepare(cfg)
    attach(prepared, cfg, run_dir)
    t0 = time.perf_counter()
    with OptimizerTimer() as timer:
        result = train(cfg, run_dir)
    total = time.perf_counter() - t0

    records = RunDir(run_dir).metrics()
    train_recs = [r for r in records if r["kind"] == "train"]
    first, rest = train_recs[0], train_recs[1:]
    prev_min = first["minutes"]
    tok = sec = 0.0
    for r in rest:
        dt = (r["minutes"] - prev_min) * 60
        tok += r["tokens_per_s"] * dt
        sec += dt
        prev_min = r["minutes"]
    lo, hi = first["step"], rest[-1]["step"]  # window: steps lo+1 .. hi (1-based)
    compute = sum(r["step_seconds"] for r in rest)  # the trainer's time in train_step
    optimizer = sum(timer.seconds[lo:hi])
    parts = {"step_but_optimizer": compute - optimizer, "optimizer": optimizer}
    window_tokens = rest[-1]["tokens"] - first["tokens"]  # trained in steps lo+1 .. hi
    row = {
        "arch": arch,
        "precision": precision,
        "steps": result.progress.step,
        "stop_reason": result.stop_reason,
        "window_steps": f"{lo + 1}-{hi}",
        "window_seconds": sec,
        "window_tokens": window_tokens,
        "tokens_per_s": tok / sec,
        "tokens_per_s_median_record": bu.median([r["tokens_per_s"] for r in rest]),
        "compute_seconds": compute,
        "compute_tokens_per_s": window_tokens / compute,
        "overhead_pct": 100 * (1 - compute / sec),
        **{f"{k}_pct": 100 * v / sec for k, v in parts.items()},
        "run_seconds_total": total,
        "last_loss": rest[-1]["loss"],
    }
    if args.pure:
        pure = pure_seconds(cfg, prepared, lo, hi, precision)
        row["pure_seconds"] = pure
        row["pure_tokens_per_s"] = window_tokens / pure
        row["overhead_pure_pct"] = 100 * (1 - pure / sec)
    print(
        f"  {arch} {precision}: {row['tokens_per_s']:,.0f} tgt tok/s over steps {row['window_steps']}, "
        f"overhead {row['overhead_pct']:.1f}%"
        + (f" (pure-loop cross-check {row['overhead_pure_pct']:.1f}%)" if args.pure else "")
    )
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bu.setup_torch(args.threads)
    bu.default_env()
    bu.warn_if_busy()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_train_"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for arch in args.archs:
            for precision in args.precisions:
                rows.append(run_one(arch, precision, args, root))
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    columns = [
        ("arch", "arch"),
        ("precision", "prec"),
        ("window_steps", "steps"),
        ("tokens_per_s", "tgt tok/s"),
        ("tokens_per_s_median_record", "median rec"),
        ("compute_tokens_per_s", "compute tok/s"),
        ("step_but_optimizer_pct", "fwd+bwd+clip %"),
        ("optimizer_pct", "adam %"),
        ("overhead_pct", "overhead %"),
    ]
    if args.pure:
        columns += [("pure_tokens_per_s", "pure tok/s"), ("overhead_pure_pct", "ovh(pure) %")]
    bu.print_table(
        rows, columns, title=f"nmt.train.train, {args.steps} steps, first {args.log_every} excluded"
    )
    worst = max(r["overhead_pct"] for r in rows)
    print(f"\nlargest overhead {worst:.1f}% (target < 5%): {'OK' if worst < 5 else 'OVER TARGET'}")
    result = {
        "benchmark": "bench_train",
        "args": vars(args),
        "machine": bu.machine_info(),
        "method": "compute = the trainer's own step_seconds (time in nmt.train.train_step: "
        "forward, backward, clipping, optimizer step, zero_grad) of the window's log records; "
        "optimizer share from torch's optimizer step hooks; overhead = 1 - compute / window wall",
        "rows": rows,
    }
    bu.write_json(args.json, result)
    return result


if __name__ == "__main__":
    bu.on_nmts_allocator()
    main()
