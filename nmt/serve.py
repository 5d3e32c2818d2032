"""`nmt serve`: trained models behind HTTP (FastAPI on uvicorn), with dynamic batching.

    POST /translate   {"text": "..." | [...], "model"?, "beam"?, "nbest"?, "max_len"?, ...}
    GET  /models      what is served: architecture, languages, parameters, step, BLEU
    GET  /health      liveness: 200 as soon as the server answers
    GET  /ready       readiness: 503 until every model is loaded, then 200
    GET  /stats       requests, sentences and batches decoded so far (and, with --compile,
                      graphs the decoding processes compiled while serving: none is the aim)
    GET  /            a page to try the models (nmt/static/), /docs the OpenAPI page

Decoding: every sentence of every request joins a queue per (model, search options).
`workers` decoding threads (`Batcher`) each keep a running batch per queue they decode, the
model engine's stream (`nmt.engine`, as `nmt translate --engine` picks). Between two steps of
it a thread takes waiting sentences in, up to `max_batch_tokens` (sentences x longest source x
beam, padding included, as `nmt translate` packs) and its share of the work, a sentence of
each waiting request in turn: with nmt's own search they join the sentences half-way through
their translation (in-flight batching, `nmt.search.BeamStream`; two at a time, a lone
newcomer waiting one step for company), each searched as it would be alone, and leave the
batch as soon as they end; CTranslate2 decodes what was taken as one batch. So a long request
shares the batch with the requests behind it, and a sentence waits for no other's end. An
idle thread first gathers what arrives within `max_wait_ms`. Each request is answered when
its last sentence is decoded. The event loop only parses, validates and waits. With
`ServeSettings.processes` (`nmt serve` but for --threads), each thread runs nmt's CPU
searches in a child process of its own (`nmt.decode_process`).

Errors: a client's mistake is a 4xx JSON body `{"error": "one sentence"}`; a decoding error
fails the requests of its batch alone (each is retried alone to find the one that fails),
with a 500 and the traceback in the log. Nothing here prints: it logs through `logging`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import math
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from nmt import NMTError, __version__, config, first_line
from nmt.config import Config
from nmt.decode_process import DecodeProcess, DecodeProcessError, JoinError, Load
from nmt.device import resolve_precision
from nmt.engine import (
    ENGINES,
    Engine,
    NMTEngine,
    check_compile,
    check_compile_precision,
    open_engine,
)
from nmt.search import SearchOptions
from nmt.translate import (
    attention_of,
    decode_workers,
    search_options,
    to_translate,
    translate_lines,
    worker_threads,
)

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"

# A running batch takes newcomers this many at a time: a lone one that arrived during the last
# step waits one step for company (`Batcher`). Taking a sentence in (encoding it, the decoder's
# start, the join) costs about as much for two as for one.
JOIN_TOGETHER = 2

# (text, score) per hypothesis, best first, for every line: what an engine returns.
NBest = list[tuple[str, float]]


# -- settings and limits ------------------------------------------------------------------


@dataclass(frozen=True)
class ServeSettings:
    """How the server batches and what it accepts (`nmt serve` options)."""

    max_batch_tokens: int | None = None  # None: each model's decode.batch_tokens
    # How long an idle decoding thread lets the first waiting sentence wait for others (it
    # starts once nothing has arrived for a fifth of it); a busy thread takes sentences into
    # its running batch at its next step. Before in-flight batching, with 32 clients (beam 5,
    # the Multi30k transformer) 5 ms made batches of 9-10 sentences, 50 ms of 12-15 and
    # 10-20% more sentences/s with a lower p99 (scripts/bench_serve.py, a shared machine).
    max_wait_ms: float = 50.0
    workers: int = 0  # decoding threads; 0 = as `nmt translate` (2 on a CPU with 2+ threads)
    # each decoding thread runs the searches of nmt's own engine on CPU in a child process
    # (`nmt.decode_process`); `nmt serve` does unless --threads
    processes: bool = False
    # the decoding processes decode through compiled code (`nmt.engine.compile_decoding`),
    # compiled before the server is ready by decoding made-up sentences (`NMTEngine.warm_up`)
    compile: bool = False
    max_lines: int = 100  # lines per request
    max_body_bytes: int = 1 << 20  # request body
    max_beam: int = 32  # larger beams make one request cost as much as hundreds
    max_queued: int = 10_000  # sentences waiting at once; beyond: 503, retry later
    decode: tuple[str, ...] = ()  # decode.KEY=VALUE defaults for every model (over the run's)
    beam: int | None = None  # every model's default beam (`--beam`; its n-best lowered to it)

    def __post_init__(self) -> None:
        """Values `nmt serve` cannot run with: `NMTError` naming its option."""
        tokens, kb = self.max_batch_tokens, self.max_body_bytes // 1024
        for ok, problem in (
            (tokens is None or tokens >= 16, f"--max-batch-tokens must be >= 16 (got {tokens})"),
            (self.max_wait_ms >= 0, f"--max-wait-ms must be >= 0 (got {self.max_wait_ms:g})"),
            (self.workers >= 0, f"--workers must be >= 0, 0 = auto (got {self.workers})"),
            (self.max_lines >= 1, f"--max-lines must be >= 1 (got {self.max_lines})"),
            (self.max_body_bytes >= 1024, f"--max-body-kb must be >= 1 (got {kb})"),
            (self.max_beam >= 1, f"the beam limit must be >= 1 (got {self.max_beam})"),
            (self.max_queued >= self.max_lines, "the queue must hold one request's lines"),
        ):
            if not ok:
                raise NMTError(problem)


def max_source_tokens(cfg: Config) -> int:
    """The longest line (source subword tokens) a served model translates: twice the
    longest training sentence it kept (`data.max_len`: past that, output is not worth the
    time it takes), and within its position table when it has a bounded one (learned
    positions: `max_positions`, the source EOS included)."""
    limit = 2 * cfg.data.max_len
    if getattr(cfg.model, "positions", None) == "learned":
        limit = min(limit, cfg.model.max_positions - 1)
    return limit


# -- served models ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A model to serve: a name and a run directory or checkpoint."""

    name: str
    path: Path


class DecodeRequest(BaseModel):
    """The decoding options a request may set (the others are the run's decode section)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    beam: int | None = None
    nbest: int | None = None
    max_len: int | None = None
    max_len_a: float | None = None
    max_len_b: int | None = None
    length_penalty: float | None = None
    length_norm: Literal["gnmt", "plain"] | None = None
    patience: float | None = None
    no_repeat_ngram: int | None = None
    ban_unk: bool | None = None


@dataclass
class ServedModel:
    name: str
    engine: Engine
    config: Config  # the run's, with the server's decode defaults (`nmt serve --length-norm`)
    device: torch.device
    max_tokens: int  # source tokens per line (`max_source_tokens`)
    has_attention: bool
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the longest output a request may ask for: what the served defaults allow the longest
        # line (a request's a * |x| + b, beyond which a degenerate model keeps decoding)
        d = self.config.decode
        self.max_output_tokens = math.floor(d.max_len_a * self.max_tokens + d.max_len_b)
        self.options = lru_cache(maxsize=256)(self._options)
        self._held = contextlib.ExitStack()
        self._held.enter_context(self.engine.held())  # weights fixed while serving

    def close(self) -> None:
        self._held.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def precision(self) -> str:
        return self.engine.precision

    def translate(self, lines: list[str], opts: SearchOptions) -> list[NBest]:
        """Lines decoded in the calling thread as one batch, apart from any other (a request
        decoded again alone after its running batch failed): its token budget covers the
        lines at the longest a line may be."""
        budget = len(lines) * (self.max_tokens + 1) * opts.beam
        nbest = self.engine.translate(lines, opts, batch_tokens=budget, workers=1)
        return [[(text, hyp.score) for text, hyp in hyps] for hyps in nbest]

    def _options(self, asked: DecodeRequest, max_beam: int) -> SearchOptions:
        """The search options of a request: the run's decode section with the request's
        values on top, checked as `nmt translate` checks its options (`config.replace`,
        `search_options`, the engine's `check`); `NMTError` with one sentence when they are
        not valid."""
        values = asked.model_dump(exclude_none=True)
        if "max_len" in values:
            if "max_len_a" in values or "max_len_b" in values:
                raise NMTError("give max_len, or max_len_a and max_len_b, not both")
            if values["max_len"] < 1:
                raise NMTError(f"max_len must be >= 1 (got {values['max_len']})")
            if values["max_len"] >= self.max_output_tokens:  # the limit counts the EOS
                raise NMTError(
                    f"max_len {values['max_len']} is above this server's limit of "
                    f"{self.max_output_tokens - 1}"
                )
            # at most max_len tokens whatever the source length (the limit counts the EOS)
            values["max_len_a"], values["max_len_b"] = 0.0, values.pop("max_len") + 1
        if asked.beam is not None and asked.nbest is None:  # as nmt translate --beam
            values["nbest"] = self.config.decode.nbest_within(asked.beam)
        beam = values.get("beam", self.config.decode.beam)
        if beam > max_beam:
            raise NMTError(f"beam {beam} is larger than this server's limit of {max_beam}")
        d = config.replace(self.config, [f"decode.{k}={v}" for k, v in values.items()])
        longest = math.floor(d.decode.max_len_a * self.max_tokens + d.decode.max_len_b)
        if longest > self.max_output_tokens:
            raise NMTError(
                f"max_len_a x {self.max_tokens} + max_len_b (the output limit of the longest "
                f"line served) is {longest}, above this server's limit of "
                f"{self.max_output_tokens} tokens: ask for less"
            )
        opts = search_options(d.decode)
        self.engine.check(opts)
        return opts

    def attention_translation(self, line: str, opts: SearchOptions) -> tuple[NBest, bytes]:
        """The n-best of one line and the PNG heatmap of its 1-best's attention: the picture
        `nmt translate --attention-plot` draws (nmt's own model, forced decoding)."""
        from nmt.plots import attention_heatmap

        if not isinstance(self.engine, NMTEngine):  # has_attention was checked before
            raise RuntimeError(f"model {self.name} has no attention to draw")
        model, tok = self.engine.model, self.tokenizer
        with _one_picture:
            nbest = translate_lines(model, tok, [line], opts, 10_000, self.device, self.precision)
            text, hyp = nbest[0][0]
            att = attention_of(model, tok, line, hyp.tokens, self.device, self.precision)
            if att is None:  # has_attention was checked before
                raise RuntimeError(f"model {self.name} gave no attention")
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "attention.png"
                attention_heatmap(att.weights, att.src_pieces, att.tgt_pieces, path, title=text)
                png = path.read_bytes()
        return [(t, h.score) for t, h in nbest[0]], png


# Attention pictures are drawn one at a time, outside the batching threads: pyplot keeps
# global state, and a burst of them must not take the cores from the batches.
_one_picture = threading.Lock()


def model_info(engine: Engine) -> dict[str, Any]:
    """What /models says about a served model."""
    cfg = engine.config
    return {
        "arch": engine.arch,
        "engine": engine.name,
        "src_lang": cfg.data.src,
        "tgt_lang": cfg.data.tgt,
        **engine.facts,  # parameters, step, best_valid_bleu
        "checkpoint": str(engine.checkpoints[0]),
    }


def has_attention(engine: Engine, device: torch.device) -> bool:
    """Whether the page can draw the model's attention: nmt's own attentional models."""
    if not isinstance(engine, NMTEngine):
        return False
    probe = attention_of(engine.model, engine.tokenizer, "a", [], device, engine.precision)
    return probe is not None


def load_served(
    spec: ModelSpec,
    device: torch.device,
    precision: str | None,
    engine: str = "nmt",
    quantization: str | None = None,
    decode: tuple[str, ...] = (),
    compiled_in_child: bool = False,
    max_beam: int = ServeSettings.max_beam,
    beam: int | None = None,
) -> ServedModel:
    """Load a model to serve (`nmt.engine.open_engine`): its engine, precision (`precision`
    or its decode.precision; CTranslate2's `quantization`), default decode settings (the
    run's with `decode` overrides on top, checked for the engine now rather than at the first
    request), line limit and whether it has attention. With `compiled_in_child`, the decoding
    processes will decode it through compiled code (`NMTError` now if they cannot). A
    default `beam` replaces the run's (its n-best lowered to it, as `nmt translate --beam`
    does); the default must be within `max_beam`, the largest a request may ask for."""
    opened = open_engine([spec.path], engine, device, precision, quantization)
    overrides = list(decode)
    if beam is not None:
        nbest = opened.config.decode.nbest_within(beam)
        overrides += [f"decode.beam={beam}", f"decode.nbest={nbest}"]
    served = ServedModel(
        name=spec.name,
        engine=opened,
        config=config.replace(opened.config, overrides),
        device=device,
        max_tokens=max_source_tokens(opened.config),
        has_attention=has_attention(opened, device),
    )
    beam = served.config.decode.beam
    if beam > max_beam:  # every request that does not ask for a beam would be refused
        raise NMTError(
            f"model {spec.name} decodes with beam {beam} by default, above the "
            f"{max_beam} a request may ask for; serve it with --beam {max_beam} or less"
        )
    try:
        served.options(DecodeRequest(), 1 << 30)
    except NMTError as e:
        raise NMTError(f"model {spec.name}: {e}") from None
    if compiled_in_child:  # can the children compile it?
        check_compile(opened.model, opened.arch, opened.precision)  # type: ignore[attr-defined]
    served.info = {
        "name": spec.name,
        **model_info(opened),
        "beam": served.config.decode.beam,
        "nbest": served.config.decode.nbest,
        "precision": opened.precision,
        "attention": served.has_attention,
        "max_line_tokens": served.max_tokens,
        "max_output_tokens": served.max_output_tokens,
    }
    return served


# -- the batching queue ---------------------------------------------------------------------


def in_child(settings: ServeSettings, device: torch.device) -> bool:
    """Whether nmt's own engine on `device` decodes in the decoding threads' child processes
    (`nmt.decode_process`) rather than in the server's."""
    return settings.processes and device.type == "cpu"


def serving_workers(workers: int | None, device: torch.device) -> int:
    """The decoding threads of a server (`--workers`, else as many as `nmt translate` runs)."""
    return workers or decode_workers(0, device, 1 << 30)


@dataclass
class Job:
    """One request's sentences in the queue: results fill in as they are decoded."""

    model: ServedModel
    opts: SearchOptions
    lines: list[str]
    pending: deque  # (index, cost) not yet taken, shortest first
    done: Callable[[list[NBest] | None, BaseException | None], None]
    arrived: float
    results: list[NBest | None] = field(default_factory=list)
    remaining: int = 0
    decoding: int = 0  # sentences taken and not yet decoded
    failed: bool = False
    cancelled: bool = False


@dataclass
class Stats:
    requests: int = 0
    sentences: int = 0
    batches: int = 0  # groups of sentences taken from the queue into a decoding batch
    combined_batches: int = 0  # batches holding sentences of 2 or more requests
    failed_requests: int = 0
    largest_batch: int = 0
    steps: int = 0  # decoding steps (a whole batch, for an engine without in-flight batching)
    step_sentences: int = 0  # sentences in those steps, summed
    joined: int = 0  # sentences that joined a batch half-way through others' decoding
    held: int = 0  # steps at which a running batch left a lone newcomer for the next one

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        del out["step_sentences"]
        out["sentences_per_batch"] = self.sentences / self.batches if self.batches else None
        out["sentences_per_step"] = self.step_sentences / self.steps if self.steps else None
        return out


@dataclass
class Slot:
    """A decoding thread's running batch for one queue (model and search options): the
    engine's stream and what each sentence in it is (job, line index, cost)."""

    stream: Any  # nmt.engine.Stream
    members: dict[int, tuple[Job, int, int]] = field(default_factory=dict)
    # added since the last step: a child's stream sends them with the step, which raises
    # `JoinError` when they cannot join (`nmt.decode_process.RemoteStream`)
    joining: list[int] = field(default_factory=list)

    def cost(self, extra: int = 0, longest: int = 0) -> int:
        """Sentences x the longest one's cost, with `extra` more of cost up to `longest`."""
        costs = [c for _, _, c in self.members.values()]
        return (len(costs) + extra) * max([longest, *costs])


class Batcher:
    """Sentences of many requests decoded together, by `workers` threads (see the module
    docstring). `submit` is called on the event loop; everything else runs in the threads.

    Each thread keeps a running batch per queue it decodes (a `Slot`: the engine's stream).
    Between two steps it takes waiting sentences into them: into a running batch as long as
    sentences x its longest cost stays within the budget and the thread holds no more than
    its share of all the sentences being decoded or waiting (so that 2 threads decode 16
    each of 32, not 32 beside an idle core); sentences of the requests with the fewest in
    flight first, so that a short request sent after a long one joins at once. With nmt's
    engine they join the sentences half-way through their translation (in-flight batching)
    and leave when done. A running batch takes them `JOIN_TOGETHER` at a time: one sentence
    for it alone, arrived during its last step, waits one step more (no longer), for company
    (under load, the next sentence arrives by then). A thread with nothing to decode waits
    first until the oldest waiting sentence has waited `max_wait` seconds, or nothing has
    arrived for a fifth of that (a burst of requests is over: a lone request does not wait
    the whole time), or the waiting sentences fill a batch. With 2 threads on 2 cores, each
    has half of torch's threads (the way `decode_batches` keeps both cores busy).

    With `loads`, each thread starts a child process that loads those models
    (`nmt.decode_process.DecodeProcess`, with the thread's share of torch's threads) and runs their
    running batches there: the thread schedules, its child searches, and two searches do not
    take turns at one interpreter's lock. Other models' batches run in the thread."""

    def __init__(
        self,
        max_batch_tokens: int | None,
        max_wait_ms: float,
        workers: int,
        loads: list[Load] | None = None,
    ) -> None:
        self.budget = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.workers = workers
        self.loads = list(loads or [])
        self.processes: list[DecodeProcess] = []  # the threads' children, once started
        self.stats = Stats()
        self._queues: dict[tuple[str, SearchOptions], deque[Job]] = {}
        self._costs: dict[tuple[str, SearchOptions], int] = {}  # waiting cost per queue
        self._queued = 0  # sentences waiting
        self._decoding = 0  # sentences in the threads' running batches
        self._cond = threading.Condition()
        self._closing = False
        self._threads: list[threading.Thread] = []

    @property
    def queued(self) -> int:
        return self._queued

    def start(self) -> Batcher:
        """Start the decoding threads, each with its share of the calling thread's torch
        threads (the process' count is left as it was), and their decoding processes (loaded
        when this returns; `NMTError` when one cannot start)."""
        before = torch.get_num_threads()
        threads = worker_threads(self.workers)
        if self.loads:  # started one after the other: loading takes both cores
            try:
                for _ in range(self.workers):
                    self.processes.append(DecodeProcess(self.loads, threads).start())
            except BaseException as e:
                for process in self.processes:
                    process.close()
                if isinstance(e, DecodeProcessError):
                    raise NMTError(f"a decoding process could not start: {first_line(e)}") from None
                raise
        started = threading.Barrier(self.workers + 1)
        for i in range(self.workers):
            process = self.processes[i] if self.processes else None
            t = threading.Thread(
                target=self._work,
                args=(threads, started, process),
                name=f"nmt-serve-{i}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)
        started.wait()
        torch.set_num_threads(before)  # for the threads that start later
        return self

    def submit(
        self,
        model: ServedModel,
        opts: SearchOptions,
        lines: list[str],
        lengths: list[int],
        done: Callable[[list[NBest] | None, BaseException | None], None],
    ) -> Job:
        """Queue the (non-empty, stripped) lines of one request; `done(results, error)` is
        called from a decoding thread once all are decoded, or one of them fails."""
        costs = [(n + 1) * opts.beam for n in lengths]  # source tokens + EOS, x beam
        order = sorted(range(len(lines)), key=lambda i: costs[i])
        job = Job(model, opts, lines, deque((i, costs[i]) for i in order), done, time.monotonic())
        job.results, job.remaining = [None] * len(lines), len(lines)
        with self._cond:
            if self._closing:
                raise RuntimeError("the server is shutting down")
            key = (model.name, opts)
            self._queues.setdefault(key, deque()).append(job)
            self._costs[key] = self._costs.get(key, 0) + sum(costs)
            self._queued += len(lines)
            self.stats.requests += 1
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: its sentences not yet taken are dropped (those being
        decoded finish, unanswered)."""
        with self._cond:
            job.cancelled = True
            self._drop(job)

    def _drop(self, job: Job) -> None:
        """Take a job's waiting sentences out of the queue (under the lock)."""
        key = (job.model.name, job.opts)
        queue = self._queues.get(key)
        if queue is not None and job in queue:
            self._queued -= len(job.pending)
            self._costs[key] -= sum(c for _, c in job.pending)
            queue.remove(job)
            if not queue:
                del self._queues[key], self._costs[key]
        job.pending.clear()

    def close(self) -> None:
        """Decode what is queued, then stop the threads and their processes (the server is
        shutting down)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        for process in self.processes:
            process.close()

    # -- in the decoding threads --------------------------------------------------------------
    def _work(
        self, threads: int, started: threading.Barrier, process: DecodeProcess | None
    ) -> None:
        # This thread's intra-op threads. torch sets a thread's count from the process' one
        # at its first parallel operation unless it has been asked already: ask first, set
        # after, so that `start` may restore the process' count.
        torch.get_num_threads()
        torch.set_num_threads(threads)
        started.wait()
        slots: dict[tuple[str, SearchOptions], Slot] = {}
        ids = itertools.count()
        stepped = -math.inf  # when this thread's last round of steps began
        while True:
            taken = self._next(slots, stepped)
            if taken is None:
                return
            for key, batch in taken:
                if key not in slots:
                    job = batch[0][0]
                    try:
                        stream, process = self._stream(job, process)
                    except Exception as e:  # decoded alone, or failed, request by request
                        self._recover(batch, e)
                        continue
                    slots[key] = Slot(stream)
                self._add(slots[key], batch, ids)
            stepped = time.monotonic()
            for key, slot in list(slots.items()):
                if slot.members:
                    self._step(slot)
                if not slot.members:
                    del slots[key]

    def _stream(self, job: Job, process: DecodeProcess | None) -> tuple[Any, DecodeProcess | None]:
        """A new running batch for `job`'s queue: in this thread's child process when it has
        the model, else in the thread; and the child to use from now on (None once a child
        that had ended could not be started again: the thread then decodes by itself)."""
        if process is None or job.model.name not in process.loads:
            return job.model.engine.stream(job.opts), process
        try:
            return process.stream(job.model.name, job.opts), process
        except DecodeProcessError as e:  # a new child could not start
            log.error(
                "%s: %s; this thread decodes in the server's process from now on",
                threading.current_thread().name,
                first_line(e),
            )
            return job.model.engine.stream(job.opts), None

    def _budget(self, jobs: deque[Job]) -> int:
        return self.budget or jobs[0].model.config.decode.batch_tokens

    def _next(self, slots: dict[tuple[str, SearchOptions], Slot], stepped: float) -> list | None:
        """What to add to this thread's running batches before its next step (its last round
        of steps began at `stepped`): [(queue key, [(job, line index, cost)])], possibly none;
        None once the server is closing and nothing is left to decode."""
        with self._cond:
            while True:
                mine = sum(len(slot.members) for slot in slots.values())
                if mine and self._queues and self._alone(mine, stepped):
                    self.stats.held += 1
                    return []
                if self._queues and (mine or self._gathered()):
                    taken = self._take(slots, mine)
                    if self._queues:
                        self._cond.notify()  # what is left may be another thread's to take
                    return taken
                if mine:
                    return []
                if self._closing:
                    return None
                if not self._queues:
                    self._cond.wait()
                    continue
                self._cond.wait(self._gathering()[2])

    def _alone(self, mine: int, stepped: float) -> bool:
        """Whether this thread, with `mine` sentences decoding, would take fewer than
        `JOIN_TOGETHER` newcomers (its share of what waits), all of which arrived after its
        last round of steps began at `stepped` (under the lock): they wait a step for company."""
        if not 0 < min(self._share(mine), self._queued) < JOIN_TOGETHER or self._closing:
            return False
        _, jobs = self._oldest()
        return jobs[0].arrived > stepped

    def _oldest(self) -> tuple[tuple[str, SearchOptions], deque[Job]]:
        """The queue whose first request has waited longest, and its key (under the lock)."""
        key = min(self._queues, key=lambda k: self._queues[k][0].arrived)
        return key, self._queues[key]

    def _share(self, mine: int) -> int:
        """How many more sentences this thread, with `mine` decoding, would hold to have its
        share of all that are decoding or waiting (under the lock; may be 0 or less)."""
        return -(-(self._queued + self._decoding) // self.workers) - mine

    def _gathering(self) -> tuple[tuple[str, SearchOptions], deque[Job], float]:
        """The queue waiting longest, its key, and how many seconds more an idle thread gathers
        for it (0 or less: none): until its first request has waited `max_wait`, or nothing
        has arrived for a fifth of that (under the lock)."""
        key, jobs = self._oldest()
        now = time.monotonic()
        waited, quiet = now - jobs[0].arrived, now - jobs[-1].arrived
        return key, jobs, min(self.max_wait - waited, self.max_wait / 5 - quiet)

    def _gathered(self) -> bool:
        """Whether an idle thread starts now (under the lock): see the class docstring."""
        if self._closing:
            return True
        key, jobs, left = self._gathering()
        return left <= 0 or self._costs[key] >= self._budget(jobs)

    def _take(self, slots: dict, mine: int) -> list:
        """Waiting sentences for this thread's running batches (under the lock): within each
        batch's budget, and no more in all than this thread's share of the sentences being
        decoded or waiting; a sentence of each waiting request in turn, the requests with the
        fewest sentences in flight first."""
        share = max(self._share(mine), 1 if not mine else 0)
        taken = []
        for key in sorted(self._queues, key=lambda k: self._queues[k][0].arrived):
            if share <= 0:
                break
            jobs = self._queues[key]
            slot = slots.get(key)
            budget = self._budget(jobs)
            batch: list[tuple[Job, int, int]] = []
            longest, cost_taken, full = 0, 0, False
            order = sorted(jobs, key=lambda j: (j.decoding, j.arrived))
            while not full and len(batch) < share:
                took = False
                for job in order:
                    if not job.pending:
                        continue
                    i, cost = job.pending[0]
                    longest_next = max(longest, cost)
                    if slot is not None:
                        size = slot.cost(len(batch) + 1, longest_next)
                    else:
                        size = (len(batch) + 1) * longest_next
                    if (batch or (slot is not None and slot.members)) and size > budget:
                        full = True
                        break
                    if len(batch) >= share:
                        full = True
                        break
                    job.pending.popleft()
                    job.decoding += 1
                    batch.append((job, i, cost))
                    longest, cost_taken, took = longest_next, cost_taken + cost, True
                full = full or not took
            if not batch:
                continue
            left = deque(j for j in jobs if j.pending)
            if left:
                self._queues[key] = left
                self._costs[key] -= cost_taken
            else:
                del self._queues[key], self._costs[key]
            self._queued -= len(batch)
            self._decoding += len(batch)
            share -= len(batch)
            self.stats.batches += 1
            self.stats.sentences += len(batch)
            self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
            self.stats.combined_batches += len({id(job) for job, _, _ in batch}) > 1
            taken.append((key, batch))
        return taken

    def _add(self, slot: Slot, batch: list[tuple[Job, int, int]], ids: Iterator[int]) -> None:
        over = [m[0].failed or m[0].cancelled for m in batch]
        if any(over):  # their requests are over: counted out, not decoded
            self._finish([(m, []) for m, gone in zip(batch, over) if gone])
            batch = [m for m, gone in zip(batch, over) if not gone]
        if not batch:
            return
        new = {next(ids): member for member in batch}
        try:
            slot.stream.add([job.lines[i] for job, i, _ in batch], list(new))
        except Exception as e:  # these sentences never joined the running batch
            self._recover(list(new.values()), e)
            return
        slot.members.update(new)
        slot.joining += new

    def _step(self, slot: Slot) -> None:
        joining, slot.joining = slot.joining, []
        try:
            ended = slot.stream.step()
        except JoinError as e:  # those added since the last step never joined; nothing stepped
            self._recover([slot.members.pop(sid) for sid in joining], e)
            return
        except Exception as e:  # the running batch is lost (the slot goes with its members)
            members = list(slot.members.values())
            slot.members.clear()
            self._recover(members, e)
            return
        with self._cond:
            self.stats.steps += 1
            self.stats.step_sentences += len(slot.members)
            if len(joining) < len(slot.members):  # beside sentences already decoding
                self.stats.joined += len(joining)
        self._finish(
            [(slot.members.pop(sid), [(t, h.score) for t, h in nbest]) for sid, nbest in ended]
        )

    def _finish(self, decoded: list[tuple[tuple[Job, int, int], NBest]]) -> None:
        """Record decoded sentences; answer the requests that are complete."""
        finished = []
        with self._cond:  # a request's sentences may be decoded by two threads at once
            for (job, i, _), nbest in decoded:
                job.decoding -= 1
                self._decoding -= 1
                if job.failed or job.cancelled:
                    continue
                job.results[i] = nbest
                job.remaining -= 1
                if job.remaining == 0:
                    finished.append(job)
        for job in finished:
            job.done(job.results, None)

    def _recover(self, members: list[tuple[Job, int, int]], error: Exception) -> None:
        """Decoding `members` failed with `error`. The sentences of one request: that request
        fails. Of several: each request's are decoded again alone (`ServedModel.translate`),
        so that the one that fails fails alone and the others are answered."""
        groups: dict[int, list[tuple[Job, int, int]]] = {}
        for member in members:
            groups.setdefault(id(member[0]), []).append(member)
        for group in groups.values():
            job = group[0][0]
            if len(groups) == 1 or job.failed or job.cancelled:
                if not job.cancelled:
                    self._fail(job, error)
                self._finish([(m, []) for m in group])  # counted out, not recorded
                continue
            try:
                results = job.model.translate([job.lines[i] for _, i, _ in group], job.opts)
            except Exception as e:
                self._fail(job, e)
                results = [[] for _ in group]
            self._finish(list(zip(group, results)))

    def _fail(self, job: Job, error: Exception) -> None:
        with self._cond:
            if job.failed:  # its sentences in another batch failed already
                return
            job.failed = True
            self._drop(job)
            self.stats.failed_requests += 1
        log.error(
            "decoding failed for a request of %d line(s) to model %s:\n%s",
            len(job.lines),
            job.model.name,
            "".join(traceback.format_exception(error)),
        )
        job.done(None, error)


# -- requests and answers ---------------------------------------------------------------------


class TranslateRequest(DecodeRequest):
    """POST /translate. `text`: one line or a list of lines (each translated alone, answers
    in the same order); `model`: a served model's name (default: the first one); decoding
    options as `nmt translate`'s (beam, nbest, max_len_a, max_len_b, length_penalty,
    length_norm, patience, no_repeat_ngram, ban_unk), and `max_len`: at most this many output
    tokens; `scores`: add each translation's score; `attention`: add the PNG heatmap of the
    1-best's attention (one line only)."""

    text: str | list[str]
    model: str | None = None
    scores: bool = False
    attention: bool = False


class Hyp(BaseModel):
    text: str
    score: float


class Translation(BaseModel):
    text: str
    score: float | None = None  # with "scores" (or nbest > 1); null for an empty line
    nbest: list[Hyp] | None = None  # with nbest > 1
    attention: str | None = None  # with "attention": a data: URL of a PNG


class TranslateResponse(BaseModel):
    model: str
    translations: list[Translation]


class ErrorBody(BaseModel):
    error: str


class ApiError(Exception):
    """A request the server cannot answer: status code and one sentence for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


DECODE_FIELDS = set(DecodeRequest.model_fields)


def _field_error(errors: list[dict[str, Any]]) -> str:
    """One sentence for pydantic's first error about a request body."""
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'decode error')})"
    if not loc or kind in ("model_type", "model_attributes_type", "dict_type"):
        return 'the body must be a JSON object, such as {"text": "A dog runs."}'
    name = str(loc[0])
    if kind == "missing":
        return f"field '{name}' is required"
    if kind == "extra_forbidden":
        known = ", ".join(TranslateRequest.model_fields)
        return f"unknown field '{name}'; the fields are: {known}"
    if name == "text":
        return "field 'text' must be a string or a list of strings"
    expected = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false"}
    if kind in expected:
        return f"field '{name}' must be {expected[kind]}"
    if kind in ("string_type", "str_type"):
        return f"field '{name}' must be a string"
    return f"field '{name}': {e.get('msg', 'invalid value')}"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


# -- the app --------------------------------------------------------------------------------


class ServerState:
    """The app's models and batcher, set once loading is done."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.models: dict[str, ServedModel] = {}
        self.default: str | None = None
        self.batcher: Batcher | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._loader: threading.Thread | None = None

    def install(self, models: list[ServedModel]) -> None:
        self.models = {m.name: m for m in models}
        self.default = models[0].name
        devices = {m.device for m in models}
        workers = serving_workers(self.settings.workers, next(iter(devices)))
        s = self.settings
        loads = [  # nmt's own engine on CPU: what a child can load
            Load.of(m.name, m.engine, m.options(DecodeRequest(), 1 << 30) if s.compile else None)
            for m in models
            if in_child(s, m.device) and isinstance(m.engine, NMTEngine)
        ]
        self.batcher = Batcher(s.max_batch_tokens, s.max_wait_ms, workers, loads).start()
        self.ready.set()
        log.info(
            "ready: %s; %d decoding thread(s)%s, batches of at most %s tokens gathered for %g ms",
            ", ".join(f"{m.name} ({m.info['arch']}, {m.precision})" for m in models),
            workers,
            f", each searching in its own process ({', '.join(x.name for x in loads)})"
            if loads
            else "",
            s.max_batch_tokens or "decode.batch_tokens",
            s.max_wait_ms,
        )

    def start_loading(self, load: Callable[[], list[ServedModel]], on_error) -> None:
        def run() -> None:
            try:
                self.install(load())
            except BaseException as e:  # noqa: BLE001 - reported to the command
                self.load_error = e
                if on_error is not None:
                    on_error(e)

        self._loader = threading.Thread(target=run, name="nmt-serve-load", daemon=True)
        self._loader.start()

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        for m in self.models.values():
            m.close()

    def model(self, name: str | None) -> ServedModel:
        if not self.ready.is_set():
            raise ApiError(503, "the models are still loading; retry when /ready says 200")
        if name is None:
            return self.models[self.default]
        if name not in self.models:
            raise ApiError(
                404, f"unknown model '{name}'; this server has: {', '.join(self.models)}"
            )
        return self.models[name]


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 (announced by its
    Content-Length, or counted as it streams in) before the app reads it whole."""

    class TooLarge(Exception):
        pass

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = (
            f"the request body is larger than this server's limit of {self.limit:,} bytes; "
            "send fewer or shorter lines"
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _error(413, message)(scope, receive, send)
        seen, started = 0, False

        async def counting_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyLimit.TooLarge
            return msg

        async def watching_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyLimit.TooLarge:
            if not started:
                await _error(413, message)(scope, receive, send)


def create_app(
    models: list[ServedModel] | Callable[[], list[ServedModel]],
    settings: ServeSettings | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The HTTP app. `models`: loaded models (ready at once), or a function that loads
    them, called in a thread once the server has started (/health answers meanwhile, /ready
    says 503). `on_load_error(e)` is told when that function fails. The first model is the
    default."""
    settings = settings or ServeSettings()
    state = ServerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if callable(models):
            state.start_loading(models, on_load_error)
        else:
            state.install(list(models))
        yield
        await run_in_threadpool(state.close)  # in-flight requests are answered by now

    app = FastAPI(
        title="nmt serve",
        version=__version__,
        description='Translate with trained nmt models. Errors are `{"error": "..."}`.',
        lifespan=lifespan,
    )
    app.state.nmt = state
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    errors = {
        400: {"model": ErrorBody, "description": "not JSON"},
        404: {"model": ErrorBody, "description": "unknown model"},
        413: {"model": ErrorBody, "description": "body or line count over the limits"},
        422: {"model": ErrorBody, "description": "a field's value is not valid"},
        500: {"model": ErrorBody, "description": "decoding failed"},
        503: {"model": ErrorBody, "description": "not ready, shutting down or queue full"},
    }

    @app.exception_handler(ApiError)
    async def client_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, str(e))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> JSONResponse:
        # nobody reads it; 499 is what nginx logs for a client that closed its connection
        return _error(499, "the client closed its connection before the answer was ready")

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = list(e.errors())
        return _error(
            400 if errs and errs[0].get("type") == "json_invalid" else 422, _field_error(errs)
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.error("%s %s failed:\n%s", request.method, request.url.path, traceback.format_exc())
        return _error(500, "the server failed on this request; its log has the traceback")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        messages = {
            404: f"no such endpoint: {request.url.path}; the API is described at /docs",
            405: f"{request.method} is not allowed on {request.url.path}; see /docs",
        }
        return JSONResponse(
            {"error": messages.get(e.status_code, str(e.detail))},
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.get("/health", summary="Liveness: 200 while the server answers")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/ready",
        summary="Readiness: 200 once every model is loaded, 503 before",
        responses={503: {"model": ErrorBody}},
    )
    async def ready() -> JSONResponse:
        if state.ready.is_set():
            return JSONResponse({"ready": True, "models": list(state.models)})
        if state.load_error is not None:
            return _error(503, f"loading the models failed: {state.load_error}")
        return _error(503, "the models are still loading")

    @app.get("/models", summary="The served models (the first is the default)")
    async def list_models() -> JSONResponse:
        state.model(None)  # 503 until loaded
        return JSONResponse(
            {"default": state.default, "models": [m.info for m in state.models.values()]}
        )

    @app.get("/stats", summary="Requests, sentences and batches decoded so far")
    async def stats() -> JSONResponse:
        b = state.batcher
        if b is None:
            return JSONResponse({"ready": False})
        late = sum(p.graphs_while_serving for p in b.processes)
        warm_up = sum(p.graphs_warming_up for p in b.processes)
        return JSONResponse(
            {
                "ready": True,
                "queued_sentences": b.queued,
                **b.stats.as_dict(),
                "graphs_compiled_warming_up": warm_up,
                "graphs_compiled_while_serving": late,
            }
        )

    @app.post(
        "/translate",
        summary="Translate one line or a list of lines",
        response_model=TranslateResponse,
        responses=errors,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": TranslateRequest.model_json_schema()}},
            }
        },
    )
    async def translate(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            raw = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise ApiError(400, f"the body is not valid JSON ({msg})") from None
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply") from None
        try:
            req = TranslateRequest.model_validate(raw)
        except ValidationError as e:
            raise ApiError(422, _field_error(e.errors())) from None
        return JSONResponse(await _translate(state, req, request.is_disconnected))

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


class ClientGone(Exception):
    """The client of a request closed its connection before its answer was ready."""


GONE_POLL_S = 0.2  # how often a waiting request looks whether its client is still there


async def _answer_unless_gone(future: asyncio.Future, gone: Callable[[], Awaitable[bool]]):
    """`future`'s result, or `ClientGone` as soon as (within GONE_POLL_S) the client has
    closed its connection: uvicorn does not cancel a request's task when its client leaves,
    and what it queued would be decoded for nobody."""
    while True:
        try:
            return await asyncio.wait_for(asyncio.shield(future), GONE_POLL_S)
        except TimeoutError:
            if await gone():
                raise ClientGone from None


def _check_unicode(text: str, what: str) -> None:
    """ApiError 422 for a string JSON can carry but UTF-8 cannot: a lone surrogate
    ("\\ud800"), which the tokenizer and the answer could not take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            422, f"{what} is not valid Unicode (a lone surrogate such as \\ud800); send text"
        ) from None


async def _translate(
    state: ServerState, req: TranslateRequest, gone: Callable[[], Awaitable[bool]]
) -> dict[str, Any]:
    """The answer to a valid request; `gone` says whether its client has gone away (the
    decoding of what it queued is then cancelled)."""
    s = state.settings
    if req.model is not None:
        _check_unicode(req.model, "field 'model'")
    served = state.model(req.model)
    lines = [req.text] if isinstance(req.text, str) else req.text
    for i, line in enumerate(lines):
        _check_unicode(line, f"line {i + 1}")
    if not lines:
        raise ApiError(422, "field 'text' is an empty list; send at least one line")
    if len(lines) > s.max_lines:
        raise ApiError(
            413,
            f"{len(lines)} lines are more than this server's limit of {s.max_lines} per "
            "request; send them in several requests",
        )
    for i, line in enumerate(lines):
        if "\n" in line or "\r" in line:
            raise ApiError(
                422, f"line {i + 1} holds a line break; send each line as its own list item"
            )
    try:
        opts = served.options(DecodeRequest(**req.model_dump(include=DECODE_FIELDS)), s.max_beam)
    except NMTError as e:
        raise ApiError(422, str(e)) from None
    stripped = [line.strip() for line in lines]
    todo, encoded = to_translate(lines, served.tokenizer.encode_src)
    lengths = [len(ids) for ids in encoded]
    for i, n in zip(todo, lengths):
        if n > served.max_tokens:
            raise ApiError(
                422,
                f"line {i + 1} has {n} tokens, more than model {served.name}'s limit of "
                f"{served.max_tokens}; split it into sentences",
            )

    if req.attention:
        if len(lines) != 1 or not todo:
            raise ApiError(422, "attention is drawn for one non-empty line; send one line")
        if not served.has_attention:
            why = (
                "it reads the source through one fixed context vector"
                if served.engine.name == "nmt"
                else f"{served.engine.name} returns none; serve it with --engine nmt to see it"
            )
            raise ApiError(
                422, f"model {served.name} ({served.info['arch']}) has no attention: {why}"
            )
        nbest, png = await run_in_threadpool(served.attention_translation, stripped[0], opts)
        url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        return _answer(served, req, opts, [nbest], attention=url)

    results: list[NBest] = [[] for _ in lines]
    if todo:
        b = state.batcher
        if b.queued + len(todo) > s.max_queued:
            raise ApiError(503, "the server is busy (its queue is full); retry in a moment")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(res, err) -> None:  # called in a decoding thread
            def settle() -> None:
                if future.done():  # cancelled: the client went away
                    return
                if err is not None:
                    future.set_exception(err)
                else:
                    future.set_result(res)

            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(settle)

        try:
            job = b.submit(served, opts, [stripped[i] for i in todo], lengths, done)
        except RuntimeError:
            raise ApiError(503, "the server is shutting down") from None
        try:
            decoded = await _answer_unless_gone(future, gone)
        except (asyncio.CancelledError, ClientGone):
            b.cancel(job)
            raise
        except Exception:  # logged with its traceback by the batcher
            raise ApiError(
                500, "decoding this request failed; the server's log has the traceback"
            ) from None
        for i, nbest in zip(todo, decoded):
            results[i] = nbest
    return _answer(served, req, opts, results)


def _answer(
    served: ServedModel,
    req: TranslateRequest,
    opts: SearchOptions,
    results: list[NBest],
    attention: str | None = None,
) -> dict[str, Any]:
    out = []
    for nbest in results:
        item: dict[str, Any] = {"text": nbest[0][0] if nbest else ""}
        if req.scores or opts.nbest > 1:
            item["score"] = nbest[0][1] if nbest else None
        if opts.nbest > 1:
            item["nbest"] = [{"text": t, "score": sc} for t, sc in nbest]
        out.append(item)
    if attention is not None:
        out[0]["attention"] = attention
    return {"model": served.name, "translations": out}


# -- running it ---------------------------------------------------------------------------


def model_specs(args: list[str]) -> list[ModelSpec]:
    """`PATH` or `NAME=PATH` per model; a model without a name is called after its run
    directory. Paths are checked here (`NMTError`), before the server starts."""
    from nmt.run import RunDir
    from nmt.translate import checkpoint_of

    specs: list[ModelSpec] = []
    for arg in args:
        name, sep, rest = arg.partition("=")
        named = bool(sep) and name and "/" not in name and not Path(arg).exists()
        path = Path(rest if named else arg)
        ckpt = checkpoint_of(path)  # NMTError when there is no run or checkpoint there
        if not named:
            name = (path if path.is_dir() else RunDir.of_checkpoint(ckpt).path).resolve().name
        if any(s.name == name for s in specs):
            raise NMTError(f"two models are called {name!r}; name them with NAME=PATH")
        specs.append(ModelSpec(name, path))
    if not specs:
        raise NMTError("give at least one run directory or checkpoint to serve")
    return specs


def listening_socket(host: str, port: int):
    """A socket bound to host:port (port 0: one the system picks), or `NMTError`."""
    import socket

    if not 0 <= port <= 65535:
        raise NMTError(f"--port must be between 0 and 65535 (got {port})")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise NMTError(f"cannot listen on {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = "; choose another --port" if e.errno == 98 else ""  # EADDRINUSE
        raise NMTError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


def serve(
    specs: list[ModelSpec],
    settings: ServeSettings,
    host: str,
    port: int,
    device: torch.device,
    precision: str | None,
    engine: str = "nmt",
    quantization: str | None = None,
) -> None:
    """Serve `specs` on host:port until SIGTERM or Ctrl-C. The models load in the background
    (/ready says when); a model that fails to load stops the server and its error is raised.

    SIGTERM: uvicorn stops accepting connections, waits for the requests in flight (the
    batcher decodes them), then the app drains the batcher; this returns normally (exit 0).
    Ctrl-C does the same and then raises KeyboardInterrupt."""
    import signal

    import uvicorn

    # bad values fail now, not in the loader
    if engine not in ENGINES:
        raise NMTError(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    if precision is not None:
        resolved = resolve_precision(precision, device, decoding=True)
        if settings.compile:
            check_compile_precision(resolved)
    if settings.compile and engine != "nmt":
        raise NMTError("--compile compiles nmt's own decoding: drop it or --engine")
    if settings.compile and not in_child(settings, device):
        raise NMTError(
            "--compile compiles the code of the decoding processes, which search on CPU: "
            + ("drop --threads" if device.type == "cpu" else f"drop --compile on {device.type}")
        )
    sock = listening_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    server: uvicorn.Server | None = None

    def stop_on_error(error: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(
        lambda: [  # with --compile, checked here and compiled by the decoding processes
            load_served(
                spec,
                device,
                precision,
                engine,
                quantization,
                settings.decode,
                settings.compile,
                settings.max_beam,
                settings.beam,
            )
            for spec in specs
        ],
        settings,
        on_load_error=stop_on_error,
    )
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", server_header=False)
    )
    log.info(
        "serving on http://%s:%d (page at /, API at /docs); loading %s",
        bound_host,
        bound_port,
        ", ".join(f"{s.name} from {s.path}" for s in specs),
    )
    # uvicorn handles SIGTERM while it runs, then raises it again for the handler it found:
    # the default one would end the process with 143 after a graceful shutdown.
    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, before)
        sock.close()
    error = app.state.nmt.load_error
    if error is not None:
        raise error
