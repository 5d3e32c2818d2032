"""Decoding processes: a server's decoding threads, and the decoding workers of `nmt translate`
and `nmt evaluate`, run nmt's search in child processes.

A search step is a few hundred small tensor operations, each with a few microseconds of
Python around its kernel. Two searches in two threads of one process take turns at the
interpreter's lock for that Python, and at a server's batch sizes they wait for it often:
keeping 16 sentences in flight each (beam 5, the Multi30k transformer recipe, bf16, 2 Zen 4
cores, no HTTP), two threads decoded 93 sentences/s, two processes 112 (55 and 57).

`DecodeProcess` starts a child process (`spawn`) that loads the models it is given as the
server loaded them (`nmt.engine.open_engine`: the same checkpoint file, precision and device)
and checks that it has the same weights and tokenizer (`fingerprint`), holds the weights fixed
and keeps their running batches. `stream(name, opts)` is a `Stream` (`nmt.engine`) whose
`step` is a message to the child (with the lines `add`ed since the last one) and its answer,
so a decoding thread of the server (`nmt.serve.Batcher`) drives a search in its own process
as it would drive one in itself, and waits for the answer without holding the lock. Results
are those of the same search in the server's process: the same code on the same weights.

Offline decoding of many lines (`helping`: lines x beam at least `HELPER_WORK`, 2,000 lines
at beam 5) does the same for the
batches of all but one decoding worker: on 2 cores, one batch is searched in the command's
process and one in a child (`BatchHelper`: `search(name, opts, src)` is a message with the
batch's token ids, answered with its n-best lists), instead of two in threads of one process.
Measured on 2 Zen 4 cores (1,000 test_2016_flickr sentences in batches of 64, beam 5,
CTranslate2's search, two workers of 1 thread each, runs alternating in one script): two
processes 269, 260, 264, 247 sentences/s in int8 against 252, 228, 234, 192 for two threads,
and 203, 192, 184, 196 against 185, 175, 159, 175 in bf16. A child takes ~1.5 s to start
(importing torch, loading the checkpoint) while the command's process decodes alone, which
less work does not win back: `nmt translate` of 3,014 lines took 16-20 s at beam 5 with or
without a child, but greedy (beam 1, 3x faster) 6.4-6.6 s with one against 5.3-5.6 s without.

An error in the child is raised in the caller as `DecodeProcessError`, with the child's
traceback in its message; lines that cannot join a running batch leave it as it was (a
`JoinError`, raised by the `step` that brought them), a failed step loses it (as in a
thread). If the child dies, the next call of each of its streams says so, and the next
`stream` starts a new child (logged); one alive but silent for `ANSWER_TIMEOUT_S` (a deadlock,
a stopped process) is killed, and taken as dead. The child ignores SIGINT and SIGTERM (from
its start: they are blocked while it is spawned): a Ctrl-C on the terminal or a service
manager's SIGTERM to the whole group reaches the server too, which answers the requests in
flight and then closes its children (`close`); a child whose server is gone reads the end of
its pipe and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import logging
import multiprocessing
import multiprocessing.resource_tracker
import multiprocessing.util  # registers its exit handler now: `_close_all` is registered after
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt import first_line
from nmt.search import Hypothesis, SearchOptions, SearchStopped
from nmt.translate import HelperUnavailable, decode_workers, worker_threads

log = logging.getLogger(__name__)

# loading: a child silent this long is stuck (one compiling warms up step by step, and says so
# at every step: its longest silence is one graph's compiling)
START_TIMEOUT_S = 600.0
# a request (a step, a batch's search): a child silent this long is stuck, and is killed (a
# step takes milliseconds, a batch's search seconds, a graph compiled while serving tens of them)
ANSWER_TIMEOUT_S = 600.0
# `helping`: offline decoding of at least this many lines x beam hands batches to child processes
HELPER_WORK = 10_000
MODEL = "model"  # the name a `BatchHelper`'s child knows its model by
SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the server's to act on, not its children's


def fingerprint(engine) -> str:
    """A digest of a loaded nmt engine's weights (every tensor of its state dict, by name)
    and tokenizer files: two processes that loaded the same checkpoint have the same one."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in engine.model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
    for path in engine.tokenizer.files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Load:
    """A model for a child to load: what `open_engine` was given, resolved (the checkpoint
    file the server loaded, its precision and device), and the `fingerprint` of what the
    server loaded, which the child's must equal."""

    name: str
    checkpoint: Path
    engine: str
    device: str
    precision: str
    fingerprint: str
    warm_up: SearchOptions | None = None  # compiled, warmed up with these before "ready"

    @property
    def compile(self) -> bool:
        """Whether the child decodes through compiled code (`warm_up` given)."""
        return self.warm_up is not None

    @classmethod
    def of(cls, name: str, engine, warm_up: SearchOptions | None = None) -> Load:
        """How a child loads `engine` (an `NMTEngine` the server loaded) under `name`; with
        `warm_up`, through compiled code (`nmt.engine.compile_decoding`), which the child
        compiles by decoding made-up sentences with those settings before it is ready."""
        return cls(
            name,
            engine.checkpoints[0],
            engine.name,
            str(engine.device),
            engine.precision,
            fingerprint(engine),
            warm_up,
        )


def _poll(conn, timeout: float, stop: threading.Event | None) -> bool:
    """`conn.poll(timeout)`, in steps of 50 ms with `stop`: `SearchStopped` once it is set."""
    if stop is None:
        return conn.poll(timeout)
    end = time.monotonic() + timeout
    while not stop.is_set():
        left = end - time.monotonic()
        if left <= 0:
            return False
        if conn.poll(min(0.05, left)):
            return True
    raise SearchStopped


class DecodeProcessError(RuntimeError):
    """Decoding in a child process failed, or the child ended."""


class JoinError(DecodeProcessError):
    """The lines added to a `RemoteStream` since its last step could not join its running
    batch (the child could not make the stream, or tokenize or encode them): the batch is as
    it was, and the step did not run."""


class DecodeProcess:
    """A child process decoding the `loads` models with `threads` intra-op threads. Use it
    from one thread at a time (a decoding thread owns it)."""

    def __init__(self, loads: list[Load], threads: int) -> None:
        self.loads = {load.name: load for load in loads}
        self.threads = threads
        self._conn: Any = None
        self._process: Any = None
        self._ids = itertools.count()
        self.started = 0  # children started: 1, or more after a child died
        # graphs its children compiled after they were ready (`nmt.engine.compiled_graphs`):
        # with --compile, each held a running batch while it compiled
        self.graphs_while_serving = 0
        self._graphs_at_ready: int | None = None  # the current child's count when ready
        self._graphs_late = 0  # ... and how many it has made since

    def start(self, stop: threading.Event | None = None) -> DecodeProcess:
        """Start the child and wait until it has loaded its models (`DecodeProcessError`
        with the child's message when it cannot; once `stop` is set, the child is killed and
        `SearchStopped` raised)."""
        ctx = multiprocessing.get_context("spawn")  # fork would copy torch's threads' state
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=_child,
            args=(child, list(self.loads.values()), self.threads),
            name="nmt-decode",
            daemon=True,
        )
        # blocked from the start: a signal to the group while the child imports torch
        # would end it; the child ignores them before it lets them in (`_child`). The first
        # spawn of a process starts multiprocessing's resource tracker, and starting it
        # unblocks SIGINT and SIGTERM (Python 3.11's `ensure_running`): it runs first, so
        # the child is spawned with them still blocked.
        multiprocessing.resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self._conn, self._process = parent, process
        self.started += 1
        self._graphs_at_ready, self._graphs_late = None, 0
        _open.add(self)
        try:
            while True:  # "loading" (a warm-up step), then "ready", or its error
                if not _poll(parent, START_TIMEOUT_S, stop):
                    raise DecodeProcessError(
                        f"the decoding process said nothing for {START_TIMEOUT_S:g} s while "
                        "it loaded"
                    )
                if self._receive(parent)[0] == "ready":
                    break
        except SearchStopped:  # killed at once: a child importing torch reads no "exit"
            self.close(timeout=0)
            raise
        except BaseException:
            self.close()
            raise
        return self

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.pid

    def alive(self) -> bool:
        process = self._process
        return process is not None and process.is_alive()

    def search(
        self,
        name: str,
        opts: SearchOptions,
        src: torch.Tensor,
        stop: threading.Event | None = None,
    ) -> list[list[Hypothesis]]:
        """Search the batch of token ids src[B,S] with model `name` in the (running) child,
        as `nmt.engine.NMTEngine.search` does. The ids travel as a numpy array: a tensor
        travels as a file descriptor of shared memory, which stays open in this process as
        long as the tensor lives (a decode keeps its batches: one descriptor per batch). Once
        `stop` is set, the child is killed and `SearchStopped` raised, as a search in this
        process stops at its next step."""
        return self.call(self.started, "search", None, name, opts, src.cpu().numpy(), stop=stop)

    def stream(self, name: str, opts: SearchOptions) -> RemoteStream:
        """A new running batch of model `name` with search options `opts` in the child (a new
        child first if the last one ended)."""
        if not self.alive():
            if self.started:
                log.warning("decoding process %s ended; starting a new one", self.pid)
            self.close()
            self.start()
        return RemoteStream(self, next(self._ids), name, opts)

    def call(self, generation: int, *message: Any, stop: threading.Event | None = None) -> Any:
        """Send a request to child number `generation`, return its answer (or raise its
        error); a stream of a child that has ended since gets `DecodeProcessError`. Once
        `stop` is set while the child works, it is killed and `SearchStopped` raised."""
        conn = self._conn
        if generation != self.started or conn is None:
            raise DecodeProcessError(
                "the decoding process that held this running batch has ended; its sentences "
                "are lost"
            )
        try:
            conn.send(message)
        except (OSError, ValueError):  # a broken pipe, or closed
            raise self._ended() from None
        try:
            answered = _poll(conn, ANSWER_TIMEOUT_S, stop)
        except SearchStopped:
            self.close(timeout=0)
            raise
        if not answered:  # alive but silent (a deadlock, a stopped process): not waited on
            pid = self.pid
            self.close(timeout=0)
            raise DecodeProcessError(
                f"the decoding process (pid {pid}) answered nothing for {ANSWER_TIMEOUT_S:g} s "
                "and was killed; its sentences are lost, and the next batch starts a new one"
            )
        return self._answer(conn)

    def _answer(self, conn) -> Any:
        return self._receive(conn)[1]

    def _receive(self, conn) -> tuple[str, Any]:
        """The child's next message: (kind, value), or its error raised."""
        try:
            kind, value, graphs = conn.recv()
        except (EOFError, OSError):
            raise self._ended() from None
        self.count_graphs(kind, graphs)
        if kind == "error":
            raise DecodeProcessError(value)
        if kind == "join-error":
            raise JoinError(value)
        return kind, value

    @property
    def graphs_warming_up(self) -> int:
        """The graphs the current child compiled before it was ready (its warm-up's; 0 while
        it loads, and for a child that compiles nothing)."""
        return self._graphs_at_ready or 0

    def count_graphs(self, kind: str, graphs: int) -> None:
        """Take note of the graphs the child has compiled since it started (every answer says
        how many): those before "ready" are its warm-up's; one more after it held a running
        batch for as long as it compiled (tens of seconds on a 2-core CPU), and is logged."""
        if kind == "ready":
            self._graphs_at_ready = graphs
        if self._graphs_at_ready is None:  # an error before it was ready
            return
        late = graphs - self._graphs_at_ready
        if late > self._graphs_late:
            self.graphs_while_serving += late - self._graphs_late
            self._graphs_late = late
            log.warning(
                "decoding process %s compiled a graph while serving (%d since it was ready): "
                "its batch waited for it; the warm-up met no batch of that shape",
                self.pid,
                late,
            )

    def _ended(self) -> DecodeProcessError:
        process = self._process
        if process is not None:
            process.join(5)
        code = None if process is None else process.exitcode
        return DecodeProcessError(
            f"the decoding process (pid {self.pid}) ended (exit code {code}); "
            "its sentences are lost, and the next batch starts a new one"
        )

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child: it is asked to exit, then killed if it has not after `timeout`."""
        conn, process = self._conn, self._process
        self._conn = self._process = None
        _open.discard(self)
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("exit",))
            conn.close()
        if process is not None:
            try:
                process.join(timeout)
            finally:  # killed even when the wait is interrupted (a second Ctrl-C at exit)
                if process.is_alive():
                    process.kill()
                    process.join()


class RemoteStream:
    """A `Stream` (`nmt.engine`) in a child process: the child's running batch number `sid`,
    of model `name` with options `opts`.

    `add` keeps the lines until `step`, which sends them with the step in one message: the
    child adds them, then steps. A message and its answer cost both processes a wake-up and
    some Python; a sentence added alone (a server's usual arrival) cost one more of each. Lines
    that cannot join make that `step` raise `JoinError` (the batch as it was, nothing
    stepped) instead of `add`. Measured (2026-11-28, 2-core Zen 4 VM, eager bf16, beam 5, a
    child of 1 thread kept at 16 of 300 test sentences in flight by a thread, passes
    alternating): 69.2, 72.9, 74.5, 70.0, 72.8 sentences/s against 64.9, 65.2, 72.1, 66.7,
    70.4 with a message per add, and the feeding thread's CPU time a third lower; compiled,
    81.6, 85.2, 89.3, 91.4, 89.2 against 82.4, 83.4, 89.0, 88.7, 88.0 (README, Serving)."""

    def __init__(self, process: DecodeProcess, sid: int, name: str, opts: SearchOptions) -> None:
        self.process, self.sid, self.name, self.opts = process, sid, name, opts
        self.generation = process.started  # the child it lives in (a restarted one has none)
        self._active = 0  # lines added (those waiting for the next step too) and not returned
        self._lines: list[str] = []  # added since the last step
        self._ids: list = []

    def __len__(self) -> int:
        return self._active

    def add(self, lines: list[str], ids: list) -> None:
        self._lines += lines
        self._ids += ids
        self._active += len(lines)

    def step(self) -> list:
        lines, ids = self._lines, self._ids
        self._lines, self._ids = [], []
        try:
            ended = self.process.call(
                self.generation, "step", self.sid, self.name, self.opts, lines, ids
            )
        except JoinError:
            self._active -= len(lines)  # they never joined; the others are as they were
            raise
        except DecodeProcessError:
            self._active = 0  # the running batch is lost
            raise
        self._active -= len(ended)
        return ended


# -- in the child -----------------------------------------------------------------------------


def _child(conn, loads: list[Load], threads: int) -> None:
    """The child's loop: load, answer "ready", then answer step (and search) requests until
    "exit" or the end of the pipe. Its running batches are the server's streams, by number:
    one the server gave up (after an error on its side) holds nothing another stream reads."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    from nmt.engine import compiled_graphs, open_engine

    def send(reply: tuple) -> bool:
        """Send (kind, value) and the count of graphs compiled so far, which the server
        follows (`DecodeProcess.count_graphs`)."""
        reply = (*reply, compiled_graphs())
        try:
            conn.send(reply)
        except OSError:  # the server is gone
            return False
        return True

    def loading() -> None:
        """A step of a warm-up done: said to the server, which waits (or has gone: stop)."""
        if not send(("loading", None)):
            raise SystemExit(0)

    torch.set_num_threads(threads)
    with contextlib.ExitStack() as held:
        try:
            engines = {}
            for load in loads:
                engine = open_engine(
                    [load.checkpoint],
                    load.engine,
                    torch.device(load.device),
                    load.precision,
                    compile=load.compile,
                )
                if fingerprint(engine) != load.fingerprint:
                    raise DecodeProcessError(
                        f"the checkpoint {load.checkpoint} or the tokenizer of model "
                        f"{load.name} changed after the server (or command) loaded them; start "
                        "it again"
                    )
                if load.warm_up is not None:
                    engine.warm_up(load.warm_up, loading)
                held.enter_context(engine.held())
                engines[load.name] = engine
        except BaseException as e:  # noqa: BLE001 - told to the server, which stops
            send(("error", _message(e)))
            return
        if not send(("ready", None)):
            return
        streams: dict[int, Any] = {}
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the server is gone
                return
            if message[0] == "exit":
                return
            kind, sid, name, opts, *args = message
            if kind == "search":  # a whole batch, no running batch kept
                try:
                    src = torch.from_numpy(args[0])
                    reply = ("ok", engines[name].search(src, opts))
                except Exception as e:  # noqa: BLE001 - raised in the caller's thread
                    reply = ("error", _message(e))
                if not send(reply):
                    return
                continue
            lines, ids = args  # "step": the lines added since the last one, then a step
            try:
                if sid not in streams:
                    streams[sid] = engines[name].stream(opts)
                if lines:
                    streams[sid].add(lines, ids)
            except Exception as e:  # noqa: BLE001 - raised in the server's thread
                reply = ("join-error", _message(e))  # the batch as it was, not stepped
            else:
                try:
                    reply = ("ok", streams[sid].step())
                except Exception as e:  # noqa: BLE001 - raised in the server's thread
                    streams.pop(sid, None)  # a failed step loses its batch
                    reply = ("error", _message(e))
            if sid in streams and not len(streams[sid]):
                del streams[sid]  # the server drops an empty batch too (`nmt.serve.Slot`)
            if not send(reply):
                return


def _message(e: BaseException) -> str:
    """An error of the child as the server logs it: its line, then the child's traceback."""
    lines = traceback.format_exception(e)
    return f"{type(e).__name__}: {e}\nin the decoding process:\n{''.join(lines).rstrip()}"


# -- offline decoding --------------------------------------------------------------------------


class BatchHelper:
    """A `nmt.translate.Helper`: searches the batches it is given in a child process of its
    own, started at its first batch (in the decoding thread that calls it), which loads the
    checkpoint `engine` loaded (`Load.of`, its weights' fingerprint taken then, beside the
    decoding). A compiled engine's child decodes through compiled code too, which it compiles
    before its first batch, warming up with that batch's search settings (minutes; the
    calling thread waits). A child that cannot start or that ends makes it raise
    `HelperUnavailable` (logged once): the caller decodes that batch and the next ones
    itself."""

    def __init__(self, engine, threads: int) -> None:
        self.engine, self.threads = engine, threads
        self.process: DecodeProcess | None = None
        self.batches = 0  # batches its child searched
        self.gone = False

    def __call__(
        self, src: torch.Tensor, opts: SearchOptions, stop: threading.Event | None = None
    ) -> list[list[Hypothesis]]:
        if self.gone:
            raise HelperUnavailable
        if self.process is None:
            try:
                # a compiled engine's child compiles too, warmed up with these settings
                load = Load.of(MODEL, self.engine, opts if self.engine.compiled else None)
                self.process = DecodeProcess([load], self.threads).start(stop)
            except SearchStopped:
                raise
            except Exception as e:  # noqa: BLE001 - this process decodes instead
                self._give_up(f"a decoding process could not start ({first_line(e)})")
        try:
            result = self.process.search(MODEL, opts, src, stop)
        except DecodeProcessError:
            if self.process.alive():  # the search failed: it fails in any process
                raise
            self._give_up(f"the decoding process {self.process.pid} ended")
        self.batches += 1
        return result

    def _give_up(self, why: str) -> None:
        self.gone = True
        log.warning("%s; its batches are decoded in this process", why)
        raise HelperUnavailable

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


def wants_helpers(engine, lines: int, opts: SearchOptions, workers: int) -> int:
    """How many `BatchHelper`s `helping` gives `engine` for decoding `lines` lines: one per
    decoding worker but the first (`nmt.translate.decode_workers`) for nmt's engine on CPU
    with one checkpoint (an ensemble's members would each load in every child), at least
    `HELPER_WORK` lines x beam (2,000 lines at beam 5, 10,000 greedy), and no sampling; else
    none."""
    if (
        getattr(engine, "name", None) != "nmt"
        or engine.device.type != "cpu"
        or len(engine.checkpoints) != 1
        or lines * opts.beam < HELPER_WORK
        or opts.sample
    ):
        return 0
    return decode_workers(workers, engine.device, lines) - 1


@contextlib.contextmanager
def helping(
    engine, lines: int, opts: SearchOptions, workers: int, helpers: int | None = None
) -> Iterator[list[BatchHelper]]:
    """For the scope: `engine` (`nmt.engine.NMTEngine`) hands the batches of all but one of
    its decoding workers to child processes (`BatchHelper`) when `wants_helpers` says so
    for decoding `lines` lines with `opts` and `workers` (`helpers`: that many instead).
    Yields the helpers; their children end with the scope."""
    n = wants_helpers(engine, lines, opts, workers) if helpers is None else helpers
    if n <= 0:
        yield []
        return
    threads = worker_threads(n + 1)  # as each of the n + 1 workers gets
    made = [BatchHelper(engine, threads) for _ in range(n)]
    engine.helpers = made
    try:
        yield made
    finally:
        engine.helpers = []
        for helper in made:
            helper.close()
        used = sum(h.batches for h in made)
        started = sum(h.process is not None and not h.gone for h in made)
        log.debug("%d batch(es) decoded in %d decoding process(es)", used, started)


# -- at the server's exit ---------------------------------------------------------------------

_open: weakref.WeakSet[DecodeProcess] = weakref.WeakSet()  # started, not closed


def _close_all() -> None:
    """At the server's exit, before multiprocessing's own exit handler joins its children
    (exit handlers run last registered first): they ignore SIGTERM, and exit when asked (or
    when their pipe ends)."""
    while _open:
        for process in list(_open):
            process.close(timeout=10)


atexit.register(_close_all)
