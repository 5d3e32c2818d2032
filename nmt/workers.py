"""Decoding processes: a server's decoding threads run nmt's search in child processes.

A search step is a few hundred small tensor operations, each with a few microseconds of
Python around its kernel. Two searches in two threads of one process take turns at the
interpreter's lock for that Python, and at a server's batch sizes they wait for it often:
keeping 16 sentences in flight each (beam 5, the Multi30k transformer recipe, bf16, 2 Zen 4
cores, no HTTP), two threads decoded 93 sentences/s, two processes 112 (55 and 57).

`DecodeProcess` starts a child process (`spawn`) that loads the models it is given as the
server loaded them (`nmt.engine.open_engine`, the same checkpoint files and precision), holds
their weights fixed and keeps their running batches. `stream(name, opts)` is a `Stream`
(`nmt.engine`) whose `add` and `step` are a message to the child and its answer, so a
decoding thread of the server (`nmt.serve.Batcher`) drives a search in its own process as it
would drive one in itself, and waits for the answer without holding the lock. Results are
those of the same search in the server's process: the same code on the same weights.

An error in the child is raised in the caller as `DecodeProcessError`, with the child's
traceback in its message; a failed `add` leaves the running batch as it was, a failed `step`
loses it (as in a thread). If the child dies, the next call says so, and the next `stream`
starts a new one. The child ignores SIGINT and SIGTERM: a Ctrl-C on the terminal or a
service manager's SIGTERM to the whole group reaches the server too, which finishes the
requests in flight and then closes its children (`close`); a child whose server is gone reads
the end of its pipe and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import signal
import threading
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt.search import SearchOptions

START_TIMEOUT_S = 600.0  # loading a model: seconds; a child silent this long is stuck


@dataclass(frozen=True)
class Load:
    """A model for a child to load: what `open_engine` was given, resolved (the checkpoint
    file the server loaded, its precision), and the facts it found (checked in the child:
    the same step and parameters, not a checkpoint saved since)."""

    name: str
    checkpoint: Path
    engine: str
    device: str
    precision: str
    facts: tuple[tuple[str, Any], ...]


class DecodeProcessError(RuntimeError):
    """Decoding in a child process failed, or the child ended."""


class DecodeProcess:
    """A child process decoding the `loads` models with `threads` intra-op threads. Use it
    from one thread at a time (a decoding thread owns it)."""

    def __init__(self, loads: list[Load], threads: int) -> None:
        self.loads = {load.name: load for load in loads}
        self.threads = threads
        self._conn: Any = None
        self._process: Any = None
        self.started = 0  # children started: 1, or more after a child died

    def start(self) -> DecodeProcess:
        """Start the child and wait until it has loaded its models (`DecodeProcessError`
        with the child's message when it cannot)."""
        ctx = multiprocessing.get_context("spawn")  # fork would copy torch's threads' state
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=_child,
            args=(child, list(self.loads.values()), self.threads),
            name="nmt-decode",
            daemon=True,
        )
        process.start()
        child.close()
        self._conn, self._process = parent, process
        self.started += 1
        _opened(self)
        try:
            if not parent.poll(START_TIMEOUT_S):
                raise DecodeProcessError(
                    f"the decoding process did not start in {START_TIMEOUT_S:g} s"
                )
            self._answer()  # "ready", or its error
        except DecodeProcessError:
            self.close()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def stream(self, name: str, opts: SearchOptions) -> RemoteStream:
        """The child's running batch of model `name` with search options `opts` (a new child
        first if the last one ended)."""
        if not self.alive():
            self.close()
            self.start()
        return RemoteStream(self, name, opts)

    def call(self, generation: int, *message: Any) -> Any:
        """Send a request to child number `generation`, return its answer (or raise its
        error); a stream of a child that has ended since gets `DecodeProcessError`."""
        if generation != self.started or self._conn is None:
            raise DecodeProcessError(
                "the decoding process that held this running batch has ended; its sentences "
                "are lost"
            )
        try:
            self._conn.send(message)
        except (OSError, ValueError):  # a broken pipe, or closed
            raise self._ended() from None
        return self._answer()

    def _answer(self) -> Any:
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._ended() from None
        if kind == "error":
            raise DecodeProcessError(value)
        return value

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
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()


class RemoteStream:
    """A `Stream` (`nmt.engine`) of a child process: model `name`, options `opts`."""

    def __init__(self, process: DecodeProcess, name: str, opts: SearchOptions) -> None:
        self.process, self.name, self.opts = process, name, opts
        self.generation = process.started  # the child it lives in (a restarted one has none)
        self._active = 0

    def __len__(self) -> int:
        return self._active

    def add(self, lines: list[str], ids: list) -> None:
        self.process.call(self.generation, "add", self.name, self.opts, lines, ids)
        self._active += len(lines)

    def step(self) -> list:
        try:
            ended = self.process.call(self.generation, "step", self.name, self.opts)
        except DecodeProcessError:
            self._active = 0  # the running batch is lost
            raise
        self._active -= len(ended)
        return ended


# -- in the child -----------------------------------------------------------------------------


def _child(conn, loads: list[Load], threads: int) -> None:
    """The child's loop: load, answer "ready", then answer add/step requests until "exit" or
    the end of the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    from nmt.engine import open_engine

    torch.set_num_threads(threads)
    with contextlib.ExitStack() as held:
        try:
            engines = {}
            for load in loads:
                engine = open_engine(
                    [load.checkpoint], load.engine, torch.device(load.device), load.precision
                )
                if tuple(sorted(engine.facts.items())) != load.facts:
                    raise DecodeProcessError(
                        f"the checkpoint {load.checkpoint} of model {load.name} changed while "
                        "the server loaded it; start the server again"
                    )
                held.enter_context(engine.held())
                engines[load.name] = engine
        except BaseException as e:  # noqa: BLE001 - told to the server, which stops
            conn.send(("error", _message(e)))
            return
        conn.send(("ready", None))
        streams: dict[tuple[str, SearchOptions], Any] = {}
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the server is gone
                return
            if message[0] == "exit":
                return
            kind, name, opts, *args = message
            key = (name, opts)
            try:
                stream = streams.get(key)
                if stream is None:
                    stream = streams[key] = engines[name].stream(opts)
                if kind == "add":
                    stream.add(*args)
                    answer = None
                else:
                    answer = stream.step()
            except Exception as e:  # noqa: BLE001 - raised in the server's thread
                if kind == "step":  # a failed step loses its batch (an add changes nothing)
                    streams.pop(key, None)
                reply = ("error", _message(e))
            else:
                if not len(stream):
                    del streams[key]
                reply = ("ok", answer)
            try:
                conn.send(reply)
            except OSError:  # the server is gone
                return


def _message(e: BaseException) -> str:
    """An error of the child as the server logs it: its line, then the child's traceback."""
    lines = traceback.format_exception(e)
    return f"{type(e).__name__}: {e}\nin the decoding process:\n{''.join(lines).rstrip()}"


_open: weakref.WeakSet[DecodeProcess] = weakref.WeakSet()  # started, not closed
_registered: list[bool] = []
_lock = threading.Lock()


def _opened(process: DecodeProcess) -> None:
    with _lock:
        if not _registered:  # after multiprocessing's exit handler: runs before it
            atexit.register(_close_all)
            _registered.append(True)
        _open.add(process)


def _close_all() -> None:
    """At the server's exit, before multiprocessing's own exit handler joins its children
    (registered later, so run first): the children ignore SIGTERM, and exit when asked."""
    for process in list(_open):
        process.close(timeout=10)
