"""Resident memory and throughput of a real `nmt train`, sampled while it runs.

What is run
  `nmt train RECIPE --run-dir TMP --set train.max_minutes=--minutes` in a child process (the
  CLI exactly as a user runs it, validation and checkpoints included), on the prepared
  Multi30k data. Every --interval seconds the child's resident set size (VmRSS, and the peak
  VmHWM) is read from /proc/PID/status; its children (none unless decoding workers fork) are
  not added.

What it reports
  * the RSS curve (one sample per interval), its peak, and its growth after the first
    --settle minutes (max - value at settle): a run whose memory is bounded is flat there;
  * the training throughput the run logged: target tokens/s of its metrics.jsonl train records
    after the first --settle minutes, weighted by each record's interval (as bench_train does),
    and the median record; compare it with scripts/bench_model.py on the same recipe and
    precision (the step alone) for the share of the step rate a real run keeps.

Commands (needs the prepared Multi30k data; saturates the cores for --minutes):
  NMT_DATA_DIR=../shared/data python scripts/bench_memory.py --minutes 30 \\
      --json runs/bench_memory.json
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
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def logged_rate(metrics: Path, settle_minutes: float) -> dict[str, float]:
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [r for r in records if r["kind"] == "train"]
    later = [r for r in train if r["minutes"] >= settle_minutes]
    if len(later) < 2:
        return {}
    tokens = seconds = 0.0
    for prev, r in zip(later, later[1:]):
        dt = (r["minutes"] - prev["minutes"]) * 60
        tokens += r["tokens_per_s"] * dt
        seconds += dt
    return {
        "tokens_per_s": tokens / seconds if seconds else float("nan"),
        "tokens_per_s_median_record": statistics.median(r["tokens_per_s"] for r in later),
        "records": len(later),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bu.default_env()
    bu.warn_if_busy()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_memory_"))
    run = root / "run"
    shutil.rmtree(run, ignore_errors=True)
    sets = [f"train.max_minutes={args.minutes}", *args.sets]
    cmd = [sys.executable, "-m", "nmt", "train", args.recipe, "--run-dir", str(run)]
    cmd += [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "COLUMNS": "200"}
    print("running:", " ".join(cmd))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    samples = []
    while proc.poll() is None:
        kb = bu.status_kb(proc.pid)
        if kb:
            minute = (time.monotonic() - t0) / 60
            samples.append(
                {"minute": minute, "rss_mb": kb["VmRSS"] / 1024, "hwm_mb": kb["VmHWM"] / 1024}
            )
            print(
                f"  {minute:6.2f} min  RSS {kb['VmRSS'] / 1024:8.0f} MB  peak {kb['VmHWM'] / 1024:8.0f} MB"
            )
        deadline = time.monotonic() + args.interval
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        print(stderr[-3000:])
        raise SystemExit(f"nmt train exited with {proc.returncode}")
    settled = [s for s in samples if s["minute"] >= args.settle]
    rate = logged_rate(run / "metrics.jsonl", args.settle)
    result = {
        "benchmark": "bench_memory",
        "args": vars(args),
        "machine": bu.machine_info(),
        "samples": samples,
        "peak_rss_mb": max((s["hwm_mb"] for s in samples), default=float("nan")),
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
            f"(median record {rate['tokens_per_s_median_record']:,.0f}, {rate['records']} records)"
        )
    bu.write_json(args.json, result)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return result


if __name__ == "__main__":
    bu.on_nmts_allocator()
    main()
