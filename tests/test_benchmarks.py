"""The benchmark scripts' own logic (scripts/_benchutil.py): what their figures are made of."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import _benchutil as bu  # noqa: E402


@pytest.mark.parametrize(
    ("op", "group"),
    [
        ("aten::mm", "matrix products"),
        ("mkldnn::_linear_pointwise", "matrix products"),
        ("quantized::linear_dynamic", "matrix products"),
        ("aten::copy_", "casts and copies"),
        ("aten::_log_softmax_backward_data", "softmax, log-softmax, loss"),
        ("aten::random_", "random numbers (dropout)"),
        ("aten::_fused_adam_", "optimizer"),
        ("aten::topk", "search: top-k, gather, reorder"),
        ("aten::amax", "search: top-k, gather, reorder"),
        ("aten::native_layer_norm", "layer norm"),
        ("aten::add_", "elementwise"),
        ("aten::view", "other"),
        ("aten::matmul", "other"),  # a wrapper: its work is counted in aten::mm
        ("aten::_to_copy", "other"),  # a wrapper of aten::copy_
        ("Optimizer.step#Adam.step", "other"),
    ],
)
def test_operators_are_grouped_by_name_without_namespace(op, group):
    assert bu.op_group(op) == group


def test_profile_sums_each_operators_own_time_by_kind_per_call():
    """Two profiled calls of a step with one product, two casts and a sum: the groups count
    those calls per step, their times add up to all operators' time, the shares to 100%."""
    a, x = torch.randn(128, 128), torch.randn(128, 128)

    def step(item):
        return (a @ item).to(torch.bfloat16).float().sum()

    prof = bu.profile_ops(step, [x], 2, "batch")
    groups = {g["name"]: g for g in prof["groups"]}
    assert prof["unit"] == "batch" and prof["count"] == 2
    assert groups["matrix products"]["calls"] == 1
    assert groups["casts and copies"]["calls"] == 2  # to bf16 and back: copy_ (under _to_copy)
    assert "elementwise" in groups  # the sum (and what it calls)
    assert sum(g["ms"] for g in prof["groups"]) == pytest.approx(prof["ops_ms"])
    assert sum(g["pct"] for g in prof["groups"]) == pytest.approx(100)
    assert [g["ms"] for g in prof["groups"]] == sorted(
        (g["ms"] for g in prof["groups"]), reverse=True
    )
    top = prof["top_ops"]
    assert [o["ms"] for o in top] == sorted((o["ms"] for o in top), reverse=True)
    assert {o["name"]: o["calls"] for o in top}["aten::mm"] == 1
    assert prof["outside_ops_ms"] == pytest.approx(max(0.0, prof["wall_ms"] - prof["ops_ms"]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and Linux allocators")
def test_memory_figures_count_a_live_tensor_as_in_use_and_resident():
    """`bench_model --memory`'s figures: a 400 MB tensor, touched, shows in the allocator's
    bytes in use while it lives and leaves them when freed; the resident set holds it, and
    grows by it but for what the allocator kept free before (pages it reuses were resident)."""
    from nmt import allocator
    from nmt.cpu import PRIMITIVE_CACHE  # set to 8,192 on import unless already set

    before = bu.memory_now()
    block = torch.ones(100 << 20)  # 400 MB, every page written
    live = bu.memory_now()
    del block
    after = bu.memory_now()
    assert live["rss_mb"] >= 400 and live["peak_rss_mb"] >= live["rss_mb"]
    assert live["onednn_cache_capacity"] == int(os.environ[PRIMITIVE_CACHE])  # nmt.cpu's default
    if allocator.heap_bytes() is None:
        pytest.skip(f"the allocator of this process ({allocator.in_use()}) gives no count")
    assert live["heap_in_use_mb"] - before["heap_in_use_mb"] >= 399
    assert abs(after["heap_in_use_mb"] - before["heap_in_use_mb"]) < 10
    assert live["rss_mb"] - before["rss_mb"] >= 390 - before["heap_free_mb"], (before, live)


def test_bench_decode_times_nmt_on_the_search_its_ctranslate2_rows_run():
    """A run's beam rows: the run's settings ("run") and the search CTranslate2 decodes it
    with ("ct2": length_norm plain and patience 1 where the run's is null, which
    `nmt.engine.CT2Engine.options` passes), a run's own patience kept; greedy search and
    fixed-length decoding are one search, and models without a run have no CTranslate2 rows."""
    import bench_decode as bd

    from nmt.config import Config, DecodeConfig
    from nmt.engine import CT2Engine

    cfg = Config()
    subject = bd.Subject("run", "transformer", None, cfg, None, [], [], run="RUN")
    args = bd.parse_args(["--run", "RUN"])
    assert args.search == "both"
    assert bd.searches(subject, "beam", args) == ["run", "ct2"]
    assert bd.searches(subject, "greedy", args) == ["run"]
    assert bd.searches(dataclasses.replace(subject, run=None), "beam", args) == ["run"]
    assert bd.searches(subject, "beam", bd.parse_args(["--run", "RUN", "--fixed-len", "20"])) == [
        "run"
    ]
    assert bd.searches(subject, "beam", bd.parse_args(["--run", "RUN", "--search", "ct2"])) == [
        "ct2"
    ]

    run = bd.nmt_options(subject, "beam", "run", args)
    assert (run.length_norm, run.patience, run.beam) == ("gnmt", None, 5)
    ct2 = bd.nmt_options(subject, "beam", "ct2", args)
    assert (ct2.length_norm, ct2.patience, ct2.beam) == ("plain", 1.0, 5)
    assert dataclasses.replace(ct2, length_norm="gnmt", patience=None) == run
    # what CTranslate2 is asked for when it decodes the run (bench_ct2_run: length_norm plain)
    engine = object.__new__(CT2Engine)  # options() reads no model for beam search
    asked = engine.options(dataclasses.replace(run, length_norm="plain"))
    assert asked["patience"] == ct2.patience and asked["beam_size"] == ct2.beam

    patient = dataclasses.replace(cfg, decode=DecodeConfig(patience=2.0))
    patient_run = dataclasses.replace(subject, cfg=patient)
    assert bd.nmt_options(patient_run, "beam", "ct2", args).patience == 2.0
    greedy = bd.nmt_options(subject, "greedy", "run", args)
    assert greedy.beam == 1


def test_bench_decode_decodes_a_runs_rows_as_nmt_translate_decodes_many_lines():
    """A run's nmt rows with 2 workers hand one worker's batches to a child process, as `nmt
    translate` does from 2,000 lines at beam 5 (`nmt.decode_process.helping`); --helpers off keeps both
    in threads. The same translations either way."""
    import bench_decode as bd
    from conftest import tiny_run

    run_dir, _ = tiny_run("transformer", 40)
    argv = ["--run", str(run_dir), "--limit", "48", "--batch-size", "8", "--workers", "2"]
    argv += ["--repeats", "1", "--warmup", "1", "--threads", "2"]
    helped_args, alone_args = bd.parse_args(argv), bd.parse_args([*argv, "--helpers", "off"])
    assert helped_args.helpers == "auto"
    (subject,) = bd.load_subjects(helped_args)
    helped, alone = bd.in_rounds(
        [
            bd.bench_nmt(subject, "beam", "fp32", helped_args),
            bd.bench_nmt(subject, "beam", "fp32", alone_args),
        ],
        2,
    )
    assert (helped["worker_processes"], alone["worker_processes"]) == (2, 1)
    assert helped["workers"] == alone["workers"] == 2
    assert helped["mean_output_tokens"] == alone["mean_output_tokens"]


def test_bench_decode_times_every_rows_passes_in_rounds():
    """All rows warm up before any is timed; then each round times one pass of every row in
    turn, and each row gets its own times and last outputs back."""
    import bench_decode as bd

    args = bd.parse_args(["--repeats", "3", "--warmup", "1"])
    calls = []

    def bench(name, rows):
        def decode_pass(batches):
            calls.append((name, len(batches)))
            return [name] * len(batches)

        times, outputs = yield from bd.timed_passes(decode_pass, list(range(4)), args, rows)
        return {"name": name, "times": times, "outputs": outputs}

    a, b = bd.in_rounds([bench("a", 1), bench("b", 2)], 2)
    # warm-ups (--warmup batches per worker), then rounds of full passes: a, b, a, b, a, b
    assert calls == [("a", 1), ("b", 2), *[("a", 4), ("b", 4)] * 3]
    assert (a["name"], b["name"]) == ("a", "b")
    assert len(a["times"]) == len(b["times"]) == 3 and all(t >= 0 for t in a["times"])
    assert a["outputs"] == ["a"] * 4 and b["outputs"] == ["b"] * 4
    assert torch.get_num_threads() == 2  # each pass starts at the threads asked for


def test_bench_decode_compiles_a_runs_fp32_and_bf16_rows_when_asked():
    """--compile on|both: a run's fp32 and bf16 rows decode through compiled code (both: each
    row eagerly and compiled, timed in the same rounds), int8 eagerly only, with a note
    (`compile_decoding` refuses it); models without a run are never compiled, and --compile
    without --run is refused. A compiled row's warm-up is a whole pass, which compiles every
    graph the timed passes need."""
    import bench_decode as bd

    from nmt.config import Config

    run = bd.Subject("run", "transformer", None, Config(), None, [], [], run="RUN")
    random = dataclasses.replace(run, run=None)
    assert bd.parse_args(["--run", "RUN"]).compile == "off"
    with pytest.raises(SystemExit):
        bd.parse_args(["--compile", "on"])
    notes: list[str] = []
    both, on = (
        bd.parse_args(["--run", "RUN", "--compile", "both"]),
        bd.parse_args(["--run", "RUN", "--compile", "on"]),
    )
    assert bd.compiled_rows(run, "bf16", both, notes) == (False, True)
    assert bd.compiled_rows(run, "fp32", on, notes) == (True,)
    assert bd.compiled_rows(random, "bf16", both, notes) == (False,)
    assert notes == []
    assert bd.compiled_rows(run, "int8", both, notes) == (False,)
    assert bd.compiled_rows(run, "int8", on, notes) == ()
    assert len(notes) == 1 and "not int8" in notes[0]
    off = bd.parse_args(["--run", "RUN"])
    assert bd.compiled_rows(run, "int8", off, notes) == (False,) and len(notes) == 1

    calls = []

    def decode_pass(batches):
        calls.append(len(batches))
        return batches

    args = bd.parse_args(["--repeats", "2", "--warmup", "1"])
    for whole, warm in ((False, 2), (True, 5)):  # 5 batches, 2 workers
        calls.clear()
        passes = bd.timed_passes(decode_pass, list(range(5)), args, 2, whole=whole)
        run_pass = next(passes)
        assert calls == [warm]
        with pytest.raises(StopIteration):
            passes.send((0.1, run_pass()))
            passes.send((0.1, run_pass()))
        assert calls == [warm, 5, 5]


def test_bench_memory_splits_a_runs_wall_time_by_the_trainers_own_clocks(tmp_path):
    import json

    import bench_memory

    # records every 60 s of wall time: 1,000 tokens each; 50 s logged per window (the other
    # 10 s validation), 40 of them in train_step
    records = [
        {
            "kind": "train",
            "minutes": float(i),
            "tokens": 1000 * i,
            "tokens_per_s": 1000 / 50,
            "step_seconds": 40.0,
        }
        for i in range(1, 6)
    ]
    records.insert(2, {"kind": "valid", "minutes": 2.1, "tokens": 2000, "loss": 2.0})
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    rate = bench_memory.logged_rate(metrics, 2.0)  # the records from minute 2: 3 windows
    assert rate["records"] == 4
    assert rate["tokens_per_s"] == pytest.approx(20.0)  # what the records log
    assert rate["tokens_per_step_second"] == pytest.approx(3000 / 120)
    assert rate["steps_share_of_logged"] == pytest.approx(40 / 50)
    assert rate["unlogged_share"] == pytest.approx(10 / 60)

    # A validation inside a record's window (valid_every not a multiple of log_every): the
    # trainer's rate, step time and `rate_tokens` cover only the steps after it (600 of the
    # window's 1,000 tokens, 24 s in train_step of the 30 s logged): the same rates, not
    # 1,000 tokens over 24 s.
    records[3].update(rate_tokens=600, tokens_per_s=600 / 30, step_seconds=24.0)
    for r in records[4:]:
        r["rate_tokens"] = 1000
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    rate = bench_memory.logged_rate(metrics, 2.0)
    assert rate["tokens_per_step_second"] == pytest.approx(2600 / 104)
    assert rate["tokens_per_step_second"] == pytest.approx(25.0)
    assert rate["steps_share_of_logged"] == pytest.approx(0.8)
    assert rate["unlogged_share"] == pytest.approx(1 - 130 / 180)


def test_bench_memory_reports_the_peak_a_child_reaches_after_the_last_sample():
    """The child's peak resident size is the kernel's (reaped with os.wait4), not only the
    largest VmHWM sampled: one that grows by 300 MB just before it ends, between two samples,
    reports it."""
    import subprocess
    import time

    import bench_memory

    code = "import time\ntime.sleep(1.5)\nb = bytearray(300 << 20)\nb[::4096] = b'x' * len(b[::4096])\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    samples, peak_mb = bench_memory.follow(proc, 60.0, time.monotonic())
    assert proc.returncode == 0
    assert len(samples) == 1 and samples[0]["hwm_mb"] < 100  # sampled at its start
    assert peak_mb >= 300


def test_bench_data_counts_no_child_where_prepare_starts_none(tmp_path):
    """With --num-proc 1 prepare starts no process: the peak is this process' own. Children
    ended before (ldconfig forked by ctypes' find_library, at this process' size then) were
    added to it as prepare's."""
    import subprocess

    import bench_data

    big = "b = bytearray(200 << 20)\nb[::4096] = b'x' * len(b[::4096])\n"
    subprocess.run([sys.executable, "-c", big], check=True)  # a child that ended, 200 MB
    threads = str(torch.get_num_threads())  # the suite's, kept
    result = bench_data.main(["--quick", "--threads", threads, "--num-proc", "1"])
    peak = result["peak_rss_mib"]
    assert peak["children_max"] == 0 and peak["total"] == peak["self_vmhwm"]


def test_bench_train_replays_the_batches_the_trainer_trained(tmp_path):
    """--pure trains the trainer's batches again: their target tokens, step by step, are
    what the trainer logged (it built them without train.batch_multiple: other batches)."""
    import bench_train
    from conftest import REPO

    from nmt import config
    from nmt.data.prepare import prepare
    from nmt.run import RunDir, attach
    from nmt.train import train

    cfg = config.load(
        REPO / "recipes" / "tiny" / "transformer.yaml",
        ["train.max_steps=6", "train.log_every=1", "train.precision=fp32"],
    )
    assert cfg.train.batch_multiple > 1
    prepared = prepare(cfg)
    attach(prepared, cfg, tmp_path / "run")
    train(cfg, tmp_path / "run")
    logged = [r["tokens"] for r in RunDir(tmp_path / "run").metrics() if r["kind"] == "train"]
    trained = [b - a for a, b in zip([0, *logged], logged)]
    split = prepared.split("train")
    replayed = [split.collate(idx).tgt_tokens for idx in bench_train.replay_batches(cfg, split, 6)]
    assert replayed == trained


def test_bench_serve_load_without_answers_has_no_latencies():
    """--warmup 0 (or a row no request finished in): no latency figures, not an IndexError."""
    import asyncio
    import math

    import bench_serve

    async def main():
        async def hang_up(reader, writer):
            writer.close()

        server = await asyncio.start_server(hang_up, bench_serve.HOST, 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await bench_serve.load(port, [], 2, 5, 10)

    row = asyncio.run(main())
    assert row["requests"] == 0
    assert all(math.isnan(row[k]) for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms"))


def test_bench_serve_sets_each_row_against_its_own_rounds_offline_pass():
    """--rounds: every client count's rows over the rounds, each against the offline pass of
    its own round (the median of those ratios, not a ratio of medians taken at other times)."""
    import bench_serve

    args = bench_serve.parse_args(["--run", "RUN", "--clients", "8", "32", "--rounds", "3"])
    assert args.rounds == 3 and bench_serve.parse_args(["--run", "RUN"]).rounds == 1
    offline = [200.0, 150.0, 180.0]  # each round's offline rate
    served = {8: [60.0, 50.0, 54.0], 32: [120.0, 120.0, 117.0]}
    rows = [
        {
            "clients": c,
            "round": r + 1,
            "sentences_per_s": served[c][r],
            "ratio_to_round_offline": served[c][r] / offline[r],
        }
        for r in range(3)
        for c in (8, 32)
    ]
    rows.append({"clients": 64, "sentences_per_s": 130.0})  # no round's pass: left out
    eight, thirty_two = bench_serve.by_rounds(rows, [8, 32, 64])
    assert eight["clients"] == 8 and eight["sentences_per_s_median"] == 54.0
    assert eight["ratios"] == pytest.approx([0.3, 1 / 3, 0.3])
    assert eight["ratio_to_round_offline_median"] == pytest.approx(0.3)
    assert thirty_two["ratio_to_round_offline_median"] == pytest.approx(0.65)
    assert thirty_two["sentences_per_s_median"] == 120.0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_bench_serve_counts_the_cpu_time_of_the_server_and_of_its_children_apart():
    """A row's CPU columns: the server's own process and its children (the decoding
    processes) from /proc, each counted where it was spent."""
    import subprocess
    import time

    import bench_serve

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (bu.cpu_seconds(child.pid) or 0) < 0.6:
            time.sleep(0.05)  # until it has spun its 0.6 s
        spent = bu.cpu_seconds(child.pid)
        assert child.pid in bu.child_pids(os.getpid())
        assert 0.6 <= spent < 2.0  # the interpreter's start and the spin, no more
        own, children = bench_serve.processes_cpu(os.getpid())
        assert children >= spent  # with any other child this process has
        t = time.process_time()
        while time.process_time() - t < 0.3:  # this process spins: counted as its own
            pass
        own_after, children_after = bench_serve.processes_cpu(os.getpid())
        assert own_after - own >= 0.25
        assert children_after - children < 0.05  # the child sleeps
    finally:
        child.kill()
        child.wait()
    assert child.pid not in bu.child_pids(os.getpid())
    assert bu.cpu_seconds(child.pid) is None  # gone


def test_bench_serve_counts_a_server_without_children_all_as_its_own():
    """With --threads the server's process decodes and has no child: its CPU time is counted
    (no children: 0), not dropped with every CPU column."""
    import subprocess
    import time

    import bench_serve

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    alone = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (bu.cpu_seconds(alone.pid) or 0) < 0.4:
            time.sleep(0.05)
        own, children = bench_serve.processes_cpu(alone.pid)
        assert own >= 0.4 and children == 0.0
    finally:
        alone.kill()
        alone.wait()
