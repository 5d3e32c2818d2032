"""Resident memory and throughput of a real `nmt train`, sampled while it runs.

What is run
  `nmt train RECIPE --run-dir TMP --set train.max_minutes=--minutes` in a child process (the
  CLI exactly as a user runs it, validation and checkpoints included), on the prepared
  Multi30k data. Every --interval seconds the child's resident set size (VmRSS, and the peak
  VmHWM) is read from /proc/PID/status; its children (none unless decoding workers fork) are
  not added.

What it reports
  * the RSS curve (one sample per interval), its peak (the child's peak resident size as the
    kernel reports it when the child ends, os.wait4: what it reached after the last sample
    too, such as the final validation; the largest sampled VmHWM is kept beside it), and its
    growth after the first --settle minutes (max - value at settle): a run whose memory is
    bounded is flat there;
  * the training throughput the run logged: target tokens/s of its metrics.jsonl train records
    after the first --settle minutes, weighted by each record's interval (as bench_train does),
    and the median record; compare it with scripts/bench_model.py on the same recipe and
    precision (the step alone) for the share of the step rate a real run keeps;
  * from the same records' `step_seconds` (the trainer's time in `nmt.train.train_step`) and
    `rate_tokens` (the tokens trained in that time: a validation or save between two records
    starts the stretch their rate covers anew): the rate inside the steps, their share of the time the records log (the rest: batches,
    logging, the loop), and the share of the wall time no record logs (validation,
    checkpoints). Shares within one run: a machine whose speed drifts between runs does not
    move them. The in-step rate against bench_model's is the step itself in a real run
    against the benchmark's.

Commands (needs the prepared Multi30k data; saturates the cores for --minutes):
  NMT_DATA_DIR=../shared/data python scripts/bench_memory.py --minutes 30 \\
      --json runs/bench_memory.json
  # issue 29's goal 2: a 10-minute run against the step alone, timed just before and after
  ... scripts/bench_memory.py --minutes 10 --settle 2 --step-rate
  # a quick look (2 minutes, RSS every 10 s):
  ... scripts/bench_memory.py --minutes 2 --interval 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(bu.RECIPES["transformer"]))
    p.add_argument("--minutes", type=float, default=30.0, help="train.max_minutes of the run")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between RSS samples")
    p.add_argument("--settle", type=float, default=3.0, help="minutes before growth is counted")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra override")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", help="keep the run directory here (default: a temporary one)")
    p.add_argument(
        "--step-rate",
        action="store_true",
        help="time the recipe's step with scripts/bench_model.py just before and just after "
        "the run, and report the run's rates against theirs",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def logged_rate(metrics: Path, settle_minutes: float) -> dict[str, float]:
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [r for r in records if r["kind"] == "train"]
    later = [r for r in train if r["minutes"] >= settle_minutes]
    if len(later) < 2:
        return {}
    # Besides the wall clock between records, the trainer's own clocks over them: each
    # record's window (its tokens over its tokens_per_s: the wall time it logs, validation and
    # checkpoints left out) and its time in train_step (`step_seconds`). Shares within one
    # run, which a machine's speed drifting between runs does not move.
    # A record's rate covers the steps since the last record, validation or save
    # (`rate_tokens`; records written before that field: the tokens since the last record).
    tokens = seconds = stepped = windows = counted = 0.0
    for prev, r in zip(later, later[1:]):
        dt = (r["minutes"] - prev["minutes"]) * 60
        tokens += r["tokens_per_s"] * dt
        seconds += dt
        covered = r.get("rate_tokens", r["tokens"] - prev["tokens"])
        windows += covered / r["tokens_per_s"]
        stepped += r["step_seconds"]
        counted += covered
    return {
        "tokens_per_s": tokens / seconds if seconds else float("nan"),
        "tokens_per_s_median_record": statistics.median(r["tokens_per_s"] for r in later),
        "records": len(later),
        "tokens_per_step_second": counted / stepped if stepped else float("nan"),
        "steps_share_of_logged": stepped / windows if windows else float("nan"),
        "unlogged_share": 1 - windows / seconds if seconds else float("nan"),
    }


def step_rate(args: argparse.Namespace) -> float:
    """The recipe's training step alone: `scripts/bench_model.py` (nmt, the precision the run
    trains in on this CPU, the run's --set overrides) in a subprocess; its target tok/s."""
    import torch

    from nmt.device import resolve_precision

    recipe = Path(args.recipe).resolve()
    arch = next((a for a, path in bu.RECIPES.items() if Path(path).resolve() == recipe), None)
    if arch is None:
        raise SystemExit(f"--step-rate times the recipes of {sorted(bu.RECIPES)} only")
    cfg = bu.load_recipe(arch, args.sets)
    precision = resolve_precision(cfg.train.precision, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench_model.json"
        cmd = [sys.executable, str(Path(__file__).with_name("bench_model.py")), "--archs", arch]
        cmd += ["--precisions", precision, "--hf", "off", "--threads", str(args.threads)]
        cmd += [x for s in args.sets for x in ("--set", s)] + ["--json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())["rows"]
    rate = next(r["tokens_per_s"] for r in rows if r["system"] == "nmt")
    print(f"bench_model {arch} {precision}: {rate:,.0f} tgt tok/s")
    return rate


def follow(proc: subprocess.Popen, interval: float, t0: float) -> tuple[list[dict], float]:
    """Sample the child's RSS (VmRSS, and its peak VmHWM, in MB) every `interval` seconds
    until it ends, then reap it: the samples, and the child's peak as the kernel reports it
    (os.wait4's rusage: what it reached after the last sample too, such as a final
    validation or the average of the last saves). Sets `proc.returncode`."""
    samples: list[dict] = []
    peak_kb = 0

    def running() -> bool:
        nonlocal peak_kb
        if proc.returncode is not None:
            return False
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == 0:
            return True
        proc.returncode = os.waitstatus_to_exitcode(status)
        peak_kb = usage.ru_maxrss
        return False

    while running():
        kb = bu.status_kb(proc.pid)
        if kb:
            minute = (time.monotonic() - t0) / 60
            samples.append(
                {"minute": minute, "rss_mb": kb["VmRSS"] / 1024, "hwm_mb": kb["VmHWM"] / 1024}
            )
            print(
                f"  {minute:6.2f} min  RSS {kb['VmRSS'] / 1024:8.0f} MB  peak {kb['VmHWM'] / 1024:8.0f} MB"
            )
        deadline = time.monotonic() + interval
        while running() and time.monotonic() < deadline:
            time.sleep(0.2)
    return samples, peak_kb / 1024


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bu.default_env()
    bu.warn_if_busy()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_memory_"))
    run = root / "run"
    shutil.rmtree(run, ignore_errors=True)
    bench_before = step_rate(args) if args.step_rate else None
    sets = [f"train.max_minutes={args.minutes}", *args.sets]
    cmd = [sys.executable, "-m", "nmt", "train", args.recipe, "--run-dir", str(run)]
    cmd += [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "COLUMNS": "200"}
    print("running:", " ".join(cmd))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    samples, child_peak_mb = follow(proc, args.interval, t0)
    stderr = proc.stderr.read()
    proc.stderr.close()
    if proc.returncode != 0:
        print(stderr[-3000:])
        raise SystemExit(f"nmt train exited with {proc.returncode}")
    settled = [s for s in samples if s["minute"] >= args.settle]
    rate = logged_rate(run / "metrics.jsonl", args.settle)
    if args.step_rate and rate:
        bench = {"before": bench_before, "after": step_rate(args)}
        bench["mean"] = (bench["before"] + bench["after"]) / 2
        rate["bench_model"] = bench
        rate["logged_over_bench"] = rate["tokens_per_s"] / bench["mean"]
        rate["in_step_over_bench"] = rate["tokens_per_step_second"] / bench["mean"]
    result = {
        "benchmark": "bench_memory",
        "args": vars(args),
        "machine": {**bu.machine_info(), "threads": args.threads},  # the child's
        "samples": samples,
        # the kernel's figure for the whole run, the samples' until the last of them
        "peak_rss_mb": max([s["hwm_mb"] for s in samples] + [child_peak_mb]),
        "peak_rss_sampled_mb": max((s["hwm_mb"] for s in samples), default=float("nan")),
        "rss_at_settle_mb": settled[0]["rss_mb"] if settled else float("nan"),
        "growth_after_settle_mb": (max(s["rss_mb"] for s in settled) - settled[0]["rss_mb"])
        if settled
        else float("nan"),
        "logged": rate,
        "steps": json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"],
    }
    print(
        f"\npeak RSS {result['peak_rss_mb']:,.0f} MB; RSS at {args.settle:g} min "
        f"{result['rss_at_settle_mb']:,.0f} MB, growth after it {result['growth_after_settle_mb']:,.0f} MB"
    )
    if rate:
        print(
            f"logged throughput after {args.settle:g} min: {rate['tokens_per_s']:,.0f} tgt tok/s "
            f"(median record {rate['tokens_per_s_median_record']:,.0f}, {rate['records']} records); "
            f"in train_step {rate['tokens_per_step_second']:,.0f} tgt tok/s, "
            f"{100 * rate['steps_share_of_logged']:.1f}% of the logged time; "
            f"{100 * rate['unlogged_share']:.1f}% of the wall time unlogged (validation, saves)"
        )
    if rate and "bench_model" in rate:
        print(
            f"against bench_model's step ({rate['bench_model']['before']:,.0f} before, "
            f"{rate['bench_model']['after']:,.0f} after): logged {rate['logged_over_bench']:.1%}, "
            f"in train_step {rate['in_step_over_bench']:.1%}"
        )
    bu.write_json(args.json, result)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return result


if __name__ == "__main__":
    bu.on_nmts_allocator()
    main()
