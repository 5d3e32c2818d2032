"""Serving speed: `nmt serve` under N concurrent clients, each sending one sentence per
request and the next as soon as the answer comes, against `nmt translate` on the same
sentences with the same beam and precision.

What is measured
  * Sentences: the --split (default test_2016_flickr, 1,000 sentences) of the run's prepared
    data (the sources `nmt evaluate` translates), in order; --requests caps how many are sent
    per row (default all of them), --seconds how long a row may take (default 120).
  * Server: `python -m nmt serve RUN --host 127.0.0.1 --port P` in a subprocess on a free
    port of 127.0.0.1 (nothing else is contacted), with --max-wait-ms, --max-batch-tokens,
    --workers, --precision and --threads passed on when given (else the server's defaults). After
    /ready, --warmup requests (untimed), then for each --clients value C: C clients in one
    asyncio loop, each on its own keep-alive connection, send POST /translate {"text":
    sentence, "beam": B}; a shared counter hands out the sentences. A client is a few lines
    of asyncio streams (HTTP/1.1, Content-Length), so that the load generator takes little of
    the 2 cores the server shares with it; its CPU time is reported (client_cpu_s). Every
    answer must be 200 with one translation.
  * CPU over a row, in cores (CPU seconds per second of the row, /proc): the server's own
    process (HTTP, the queue, the threads that schedule the decoding), its decoding processes
    together, and the load generator. On 2 cores, what the server's process and the load
    generator take is taken from decoding.
  * requests/s and sentences/s: over the row's wall time, first request sent to last answer
    received; latencies from writing a request to reading its whole answer (p50, p95, p99,
    max). Batches (groups of sentences taken from the queue at once) and decoding steps, and
    the mean number of sentences a step decoded: the server's /stats before and after the row;
    with --compile, the graphs its decoding processes compiled during the row (any holds a
    batch for as long as it compiles).
  * Offline: `nmt.translate.translate_lines` as `nmt translate RUN --beam B` runs it (the
    run's decode.batch_tokens and decode.workers, sorted by length), in this process, while
    the server is not running, after a warm-up on 64 sentences: --offline-repeats passes
    over the same sentences before the server starts and as many after it stops (the load
    of a shared machine drifts); ratio = server sentences/s / offline sentences/s of the
    median pass. Also
    how many of the server's translations equal the offline ones (batches of other
    sentences may change bf16 rounding, rarely the words).
  * With --rounds R (R > 1): R rounds, each one offline pass (in this process, the server up
    and idle: no request in flight) and then every --clients row; each row is also set against
    its own round's pass (column "x round's offline"), and each client count gets the median
    of its rounds. On a machine whose speed drifts within minutes, a row and the offline pass
    just before it meet about the same speed; the passes before and after the server do not.
  * With --alone, decoding alone at each client count C, after the server has stopped: the
    decoding processes the server runs, fed directly by a thread each that keeps its share of
    C sentences in flight (`alone`). The server's figure over this one is what HTTP, the
    queue and the scheduling cost; this one over offline is what decoding sentences that come
    and go, one at a time, costs against whole sorted batches.
  * The 1-minute load average before each part: other processes on the cores lower (and
    scatter) the numbers.

Commands:
  NMT_DATA_DIR=../shared/data NMT_CACHE_DIR=/tmp/nmtcache \\
      python scripts/bench_serve.py --run runs/multi30k_transformer --json runs/bench_serve.json
  # the README goal: 32 clients, beam 5
  ... scripts/bench_serve.py --run runs/multi30k_transformer --clients 32 --beam 5
  # the same in 5 rounds, each served row against the offline pass just before it
  ... scripts/bench_serve.py --run RUN --clients 32 --seconds 30 --offline-repeats 1 --rounds 5
  # several client counts, server settings:
  ... scripts/bench_serve.py --run RUN --clients 1 8 32 64 --max-wait-ms 10 --workers 2
  # where the time goes at 32 clients: the server, decoding alone, offline
  ... scripts/bench_serve.py --run RUN --clients 32 --alone
  # smoke test (~30 s):
  ... scripts/bench_serve.py --run RUN --clients 8 --requests 100 --offline-repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

HOST = "127.0.0.1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="trained run directory (or checkpoint)")
    p.add_argument("--clients", type=int, nargs="+", default=[32], help="a row per value")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--requests", type=int, default=None, help="per row (default: the split)")
    p.add_argument("--seconds", type=float, default=120.0, help="time limit of a row")
    p.add_argument("--warmup", type=int, default=64, help="untimed requests first")
    p.add_argument("--max-wait-ms", type=float, default=None)
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--precision", default="auto")
    p.add_argument(
        "--threads", action="store_true", help="nmt serve --threads: search in the server's process"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="nmt serve --compile (and --alone's decoding processes compiled); the offline "
        "baseline stays `nmt translate`",
    )
    p.add_argument("--offline-repeats", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of one offline pass (the server idle) and every --clients row; each row "
        "is also set against its own round's offline pass",
    )
    p.add_argument("--no-offline", action="store_true", help="skip the offline baseline")
    p.add_argument(
        "--alone",
        action="store_true",
        help="also decoding alone at each client count: the server's decoding processes fed "
        "directly, without HTTP or queue",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nmt", "serve", args.run, "--host", HOST, "--port", str(port)]
    for flag, value in (
        ("--max-wait-ms", args.max_wait_ms),
        ("--max-batch-tokens", args.max_batch_tokens),
        ("--workers", args.workers),
        ("--precision", args.precision),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if args.threads:
        cmd.append("--threads")
    if args.compile:
        cmd.append("--compile")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + (1800 if args.compile else 180)  # compiling: minutes
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}:\n{proc.stderr.read()}")
        try:
            if get_json(f"http://{HOST}:{port}/ready")[0] == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server was not ready within {1800 if args.compile else 180} s")


async def post(reader, writer, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a keep-alive connection: (status, body)."""
    writer.write(
        b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def load(
    port: int, sentences: list[str], clients: int, beam: int, seconds: float
) -> dict[str, Any]:
    """`clients` connections, each sending the next sentence as soon as it has an answer."""
    counter = itertools.count()
    latencies: list[float] = []
    outputs: dict[int, str] = {}
    deadline = time.monotonic() + seconds

    async def client() -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            while time.monotonic() < deadline and (i := next(counter)) < len(sentences):
                body = json.dumps({"text": sentences[i], "beam": beam}).encode()
                t0 = time.perf_counter()
                status, answer = await post(reader, writer, body)
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"status {status}: {answer[:200]!r}")
                outputs[i] = json.loads(answer)["translations"][0]["text"]
        finally:
            writer.close()

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    lat = np.array(latencies)

    def ms(q: float) -> float:  # no request answered (no time for one): no latency
        return 1000 * float(np.percentile(lat, q)) if len(lat) else float("nan")

    return {
        "clients": clients,
        "requests": len(latencies),
        "seconds": wall,
        "requests_per_s": len(latencies) / wall,
        "sentences_per_s": len(latencies) / wall,  # one sentence per request
        "p50_ms": ms(50),
        "p95_ms": ms(95),
        "p99_ms": ms(99),
        "max_ms": ms(100),
        "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "outputs": outputs,
    }


def processes_cpu(pid: int) -> tuple[float, float] | None:
    """CPU seconds so far of the server's process and of its children together (its
    decoding processes; none with --threads, where the server's process decodes), or None
    where /proc cannot tell."""
    own = bu.cpu_seconds(pid)
    children = [bu.cpu_seconds(c) for c in bu.child_pids(pid)]
    if own is None or None in children:
        return None
    return own, sum(children)


def offline(args: argparse.Namespace, sentences: list[str]):
    """`nmt translate RUN --beam B --precision P` on the sentences, in this process: returns
    `passes(n)`, which times n passes over them (after a warm-up on 64 sentences)."""
    import torch

    from nmt import config
    from nmt.decode_process import helping
    from nmt.engine import open_engine
    from nmt.translate import search_options

    bu.setup_torch(2)
    cpu = torch.device("cpu")
    engine = open_engine([Path(args.run)], "nmt", cpu, args.precision)
    overrides = [
        f"decode.beam={args.beam}",
        "decode.nbest=1",
        f"decode.precision={args.precision}",
    ]
    d = config.replace(engine.config, overrides).decode
    prec = engine.precision
    opts = search_options(d)

    def run(lines: list[str]) -> list[str]:
        # as nmt translate decodes them: many lines hand batches to decoding processes
        with helping(engine, len(lines), opts, d.workers):
            out = engine.translate(lines, opts, d.batch_tokens, None, d.workers)
        return [nbest[0][0] if nbest else "" for nbest in out]

    run(sentences[:64])
    info = {"precision": prec, "batch_tokens": d.batch_tokens, "workers": d.workers}

    def passes(n: int) -> dict[str, Any]:
        load = os.getloadavg()[0]
        times, texts = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            texts = run(sentences)
            times.append(time.perf_counter() - t0)
        return {"seconds": times, "load_average_1m": load, "texts": texts, **info}

    return passes


def feed(children: list, opts, sentences: list[str], clients: int, seconds: float) -> int:
    """Keep `clients` of `sentences` in flight in the decoding processes `children` (their
    shares, a thread each), the next added as soon as one ends, until all are decoded or
    `seconds` have passed (those in flight then finish); returns how many were decoded."""
    import threading

    todo, lock, done = iter(range(len(sentences))), threading.Lock(), [0]
    deadline = time.perf_counter() + seconds

    def drive(child, in_flight: int) -> None:
        stream = child.stream("model", opts)
        while True:
            with lock:
                late = time.perf_counter() > deadline
                take = [] if late else list(itertools.islice(todo, in_flight - len(stream)))
            if take:
                stream.add([sentences[i] for i in take], take)
            if not len(stream):
                return
            ended = len(stream.step())
            with lock:
                done[0] += ended

    n = len(children)
    shares = [clients // n + (i < clients % n) for i in range(n)]
    drivers = [threading.Thread(target=drive, args=cs) for cs in zip(children, shares)]
    for t in drivers:
        t.start()
    for t in drivers:
        t.join()
    return done[0]


def alone(args: argparse.Namespace, sentences: list[str]) -> dict[int, dict[str, Any]]:
    """Decoding alone at each --clients value C: the decoding processes `nmt serve` runs
    (`nmt.decode_process`: as many as its workers, each with its share of 2 torch threads,
    the same model and precision), each fed by a thread of this process that keeps its share
    of C sentences in flight (`feed`). No HTTP, no queue, no scheduling: what the server's
    decoding reaches at that concurrency."""
    import torch

    from nmt.decode_process import DecodeProcess, Load
    from nmt.serve import DecodeRequest, load_served, model_specs, serving_workers
    from nmt.translate import worker_threads

    bu.setup_torch(2)
    cpu = torch.device("cpu")
    served = load_served(model_specs([args.run])[0], cpu, args.precision)
    opts = served.options(DecodeRequest(beam=args.beam), args.beam)  # a {"beam": B} request's
    workers = serving_workers(args.workers, cpu)
    threads = worker_threads(workers)
    children = []
    try:
        for _ in range(workers):
            load = Load.of("model", served.engine, opts if args.compile else None)
            children.append(DecodeProcess([load], threads).start())
        feed(children, opts, sentences[:32], 8, args.seconds)  # warm-up
        rows = {}
        for clients in args.clients:
            t0 = time.perf_counter()
            done = feed(children, opts, sentences, clients, args.seconds)
            rate = done / (time.perf_counter() - t0)
            rows[clients] = {"sentences": done, "sentences_per_s": rate}
            print(f"{clients} in flight, decoding alone: {rate:.1f} sentences/s")
        return rows
    finally:
        for child in children:
            child.close()


def by_rounds(rows: list[dict[str, Any]], clients_values: list[int]) -> list[dict[str, Any]]:
    """--rounds: for each client count, the median of its rows' sentences/s and of their
    ratios to their own round's offline pass (rows without one are left out)."""
    summary = []
    for clients in dict.fromkeys(clients_values):
        mine = [r for r in rows if r["clients"] == clients and "ratio_to_round_offline" in r]
        if mine:
            ratios = [r["ratio_to_round_offline"] for r in mine]
            summary.append(
                {
                    "clients": clients,
                    "sentences_per_s_median": bu.median([r["sentences_per_s"] for r in mine]),
                    "ratio_to_round_offline_median": bu.median(ratios),
                    "ratios": ratios,
                }
            )
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bu.default_env()
    from nmt.data.prepare import prepare
    from nmt.run import RunDir
    from nmt.translate import read_run

    run_dir = Path(args.run)
    cfg = (
        RunDir(run_dir).saved_config([]) if run_dir.is_dir() else read_run(run_dir)[2]
    )  # the run's data settings: where its prepared sentences are
    sentences = prepare(cfg).split(args.split).texts("src")
    if args.requests:
        sentences = sentences[: args.requests]
    bu.warn_if_busy()
    info = bu.machine_info()

    # Offline passes before and after the server's rows: on a shared machine the load drifts,
    # and the ratio is taken to the median of both.
    passes = None if args.no_offline else offline(args, sentences)
    before_runs = passes(args.offline_repeats) if passes else None

    port = free_port()
    server = start_server(args, port)
    rows = []
    try:
        warm = asyncio.run(load(port, sentences[: args.warmup], 8, args.beam, 60))
        print(f"warm-up: {warm['requests']} requests")
        round_offline = None  # this round's offline rate (--rounds)
        rounds = itertools.product(range(args.rounds), enumerate(args.clients))
        for rnd, (k, clients) in rounds:
            if passes is not None and args.rounds > 1 and k == 0:
                # the round's offline pass, the server idle beside it (no request in flight)
                round_offline = len(sentences) / passes(1)["seconds"][0]
                print(f"round {rnd + 1}: offline nmt translate {round_offline:.1f} sentences/s")
            load_avg = os.getloadavg()[0]
            _, before = get_json(f"http://{HOST}:{port}/stats")
            cpu_before = processes_cpu(server.pid)
            row = asyncio.run(load(port, sentences, clients, args.beam, args.seconds))
            cpu_after = processes_cpu(server.pid)
            _, after = get_json(f"http://{HOST}:{port}/stats")
            batches = after["batches"] - before["batches"]
            steps = after["steps"] - before["steps"]
            in_steps = (after["sentences_per_step"] or 0) * after["steps"] - (
                (before["sentences_per_step"] or 0) * before["steps"]
            )
            if args.rounds > 1:
                row["round"] = rnd + 1
            if round_offline is not None:
                row["round_offline_sentences_per_s"] = round_offline
                row["ratio_to_round_offline"] = row["sentences_per_s"] / round_offline
            row.update(
                load_average_1m=load_avg,
                batches=batches,
                sentences_per_batch=(after["sentences"] - before["sentences"]) / max(batches, 1),
                steps=steps,
                sentences_per_step=in_steps / max(steps, 1),
                graphs_compiled=after["graphs_compiled_while_serving"]
                - before["graphs_compiled_while_serving"],
            )
            row["client_cpu"] = row["client_cpu_s"] / row["seconds"]
            if cpu_before is not None and cpu_after is not None:
                # cores' worth of CPU time over the row: the server's own process (HTTP, the
                # queue, the scheduling threads; with --threads the decoding too) and its
                # decoding processes together
                row["server_cpu"] = (cpu_after[0] - cpu_before[0]) / row["seconds"]
                row["decoders_cpu"] = (cpu_after[1] - cpu_before[1]) / row["seconds"]
            rows.append(row)
            print(
                f"{clients} clients: {row['sentences_per_s']:.1f} sentences/s, p99 "
                f"{row['p99_ms']:.0f} ms, {row['sentences_per_step']:.1f} sentences a step, "
                f"{row['graphs_compiled']} graphs compiled"
            )
    finally:
        server.terminate()
        server.wait(timeout=120)

    alone_rows = alone(args, sentences) if args.alone else {}
    for row in rows:
        if row["clients"] in alone_rows:
            row["alone_sentences_per_s"] = alone_rows[row["clients"]]["sentences_per_s"]

    base = None
    if passes is not None:
        after_runs = passes(args.offline_repeats)
        times = before_runs["seconds"] + after_runs["seconds"]
        base = {
            "sentences": len(sentences),
            "seconds_median": bu.median(times),
            "sentences_per_s": len(sentences) / bu.median(times),
            "sentences_per_s_before": len(sentences) / bu.median(before_runs["seconds"]),
            "sentences_per_s_after": len(sentences) / bu.median(after_runs["seconds"]),
            "load_average_1m_before": before_runs["load_average_1m"],
            "load_average_1m_after": after_runs["load_average_1m"],
            "texts": after_runs["texts"],
            **{k: after_runs[k] for k in ("precision", "batch_tokens", "workers")},
        }
        print(
            f"offline nmt translate: {base['sentences_per_s']:.1f} sentences/s (before the "
            f"server {base['sentences_per_s_before']:.1f}, after {base['sentences_per_s_after']:.1f})"
        )
    for row in rows:
        outputs = row.pop("outputs")
        if base is not None:
            row["ratio_to_offline"] = row["sentences_per_s"] / base["sentences_per_s"]
            if "alone_sentences_per_s" in row:
                row["alone_ratio_to_offline"] = (
                    row["alone_sentences_per_s"] / base["sentences_per_s"]
                )
            row["identical_to_offline"] = sum(
                base["texts"][i] == text for i, text in outputs.items()
            ) / max(len(outputs), 1)
    if base is not None:
        base.pop("texts")

    bu.print_table(
        rows,
        [
            ("clients", "clients"),
            ("requests", "requests"),
            ("requests_per_s", "req/s"),
            ("sentences_per_s", "sent/s"),
            ("p50_ms", "p50 ms"),
            ("p95_ms", "p95 ms"),
            ("p99_ms", "p99 ms"),
            ("sentences_per_step", "sent/step"),
            ("ratio_to_offline", "x offline"),
            ("round", "round"),
            ("ratio_to_round_offline", "x round's offline"),
            ("identical_to_offline", "same text"),
            ("server_cpu", "server cores"),
            ("decoders_cpu", "decoders cores"),
            ("client_cpu", "client cores"),
            ("alone_sentences_per_s", "alone sent/s"),
            ("alone_ratio_to_offline", "alone x offline"),
            ("load_average_1m", "load"),
        ],
        title=f"nmt serve, beam {args.beam}, {args.run}"
        + (f" (offline: {base['sentences_per_s']:.1f} sentences/s)" if base else ""),
    )
    summary = by_rounds(rows, args.clients) if args.rounds > 1 else []
    for entry in summary:
        print(
            f"{entry['clients']} clients over {len(entry['ratios'])} rounds: "
            f"{entry['sentences_per_s_median']:.1f} sentences/s (median), "
            f"{entry['ratio_to_round_offline_median']:.3f} of the round's offline rate (median; "
            + ", ".join(f"{x:.3f}" for x in entry["ratios"])
            + ")"
        )
    bu.write_json(
        args.json,
        {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "rounds": summary,
            "machine": info,
            "settings": {
                k: getattr(args, k)
                for k in ("run", "beam", "split", "max_wait_ms", "max_batch_tokens", "workers")
            }
            | {"precision": args.precision},
            "offline": base,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    bu.on_nmts_allocator()
    main()
