"""`nmt serve`: the app through FastAPI's TestClient and in-process async clients (endpoints,
every bad input, batching, a failing decode), then a real uvicorn process on a free port
(endpoints, concurrent clients, SIGTERM with requests in flight, the command's errors), and
the page in a headless Chromium. Tiny runs of the session (`tiny_run`, shared with
test_translate_cli.py), decoded in fp32 so outputs compare exactly with `nmt translate`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import multiprocessing.process
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import tiny_run
from fastapi.testclient import TestClient
from test_translate_cli import FP32, PNG_MAGIC, nmt_cli, ok, one_line_error, read_gz_lines

from nmt import NMTError, checkpoint, decode_process
from nmt.decode_process import DecodeProcess, DecodeProcessError, JoinError, Load
from nmt.engine import WARM_UP, NMTStream
from nmt.models.base import count_parameters
from nmt.serve import (
    GONE_POLL_S,
    Batcher,
    DecodeRequest,
    ModelSpec,
    ServeSettings,
    create_app,
    load_served,
    serve,
)
from nmt.translate import load_model, search_options, translate_lines

CPU = torch.device("cpu")
CHROMIUM = Path("/usr/bin/chromium")


# -- models and expected translations ----------------------------------------------------------


@pytest.fixture(scope="module")
def runs(multi30k_dir) -> dict[str, Path]:
    """tiny: the transformer of test_translate_cli (160 steps); s2s: a seq2seq (no attention)."""
    return {"tiny": tiny_run("transformer", 160)[0], "s2s": tiny_run("seq2seq", 40)[0]}


@pytest.fixture(scope="module")
def served(runs):
    return [load_served(ModelSpec(name, path), CPU, "fp32") for name, path in runs.items()]


@pytest.fixture(scope="module")
def english(multi30k_dir) -> list[str]:
    return read_gz_lines(multi30k_dir / "test_2016_flickr.en.gz")[:40]


@pytest.fixture(scope="module")
def alone(served):
    """line -> (text, score) of the tiny transformer translating it alone (Python API, fp32,
    the run's decode settings, or `beam`)."""
    engine = served[0].engine
    cache: dict = {}

    def translate(line: str, beam: int | None = None) -> tuple[str, float]:
        if (line, beam) not in cache:
            d = engine.config.decode
            opts = search_options(d, beam=beam, nbest=1)
            (text, hyp), *_ = translate_lines(
                engine.model, engine.tokenizer, [line], opts, d.batch_tokens, CPU, "fp32"
            )[0]
            cache[line, beam] = (text, hyp.score)
        return cache[line, beam]

    return translate


SETTINGS = ServeSettings(max_lines=8, max_body_bytes=4096, workers=2, max_wait_ms=2)


@pytest.fixture(scope="module")
def client(served):
    with TestClient(create_app(served, SETTINGS)) as c:
        yield c


def texts(answer: dict) -> list[str]:
    return [t["text"] for t in answer["translations"]]


# -- endpoints ----------------------------------------------------------------------------------


def test_translate_equals_nmt_translate(client, runs, english):
    """Lines (one empty, one of a zero-width space: no source piece) with scores: what `nmt
    translate --scores` prints, line for line; both lines without a piece empty."""
    lines = [*english[:4], "", "\u200b", *english[5:7]]
    r = client.post("/translate", json={"text": lines, "scores": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == "tiny"  # the first model is the default
    cli = ok(nmt_cli("translate", runs["tiny"], "--scores", *FP32, stdin="\n".join(lines) + "\n"))
    rows = cli.stdout.split("\n")[:-1]
    assert len(rows) == len(lines) == len(answer["translations"])
    assert rows[4] == rows[5] == "\tNA"
    for row, got in zip(rows, answer["translations"]):
        if row == "\tNA":
            assert got == {"text": "", "score": None}
            continue
        text, _, score = row.rpartition("\t")
        assert got["text"] == text
        assert got["score"] == pytest.approx(float(score), abs=1e-4)


@pytest.mark.parametrize("patience", [None, 1.5])
def test_nbest_equals_nmt_translate(client, runs, english, patience):
    lines = english[:3]
    body = {"text": lines, "beam": 3, "nbest": 3}
    args = ["--beam", "3", "--nbest", "3", *FP32]
    if patience is not None:
        body["patience"], args = patience, [*args, "--patience", str(patience)]
    r = client.post("/translate", json=body)
    assert r.status_code == 200, r.text
    cli = ok(nmt_cli("translate", runs["tiny"], *args, stdin="\n".join(lines)))
    expected = [row.split(" ||| ") for row in cli.stdout.splitlines()]
    got = [
        (i, h["text"], h["score"])
        for i, t in enumerate(r.json()["translations"])
        for h in t["nbest"]
    ]
    assert len(got) == len(expected) == 9
    for (i, text, score), (ci, ctext, cscore) in zip(got, expected):
        assert (str(i), text) == (ci, ctext)
        assert score == pytest.approx(float(cscore), abs=1e-4)
    for t in r.json()["translations"]:
        assert t["text"] == t["nbest"][0]["text"] and t["score"] == t["nbest"][0]["score"]


def test_one_string_and_the_other_model(client, english, alone):
    r = client.post("/translate", json={"text": english[0]})
    assert r.json() == {"model": "tiny", "translations": [{"text": alone(english[0])[0]}]}
    r = client.post("/translate", json={"text": english[0], "model": "s2s", "beam": 1})
    assert r.status_code == 200 and r.json()["model"] == "s2s"
    assert r.json()["translations"][0]["text"]


def test_max_len_bounds_the_output(client, served, english):
    r = client.post("/translate", json={"text": english[:6], "max_len": 3, "beam": 2})
    assert r.status_code == 200, r.text
    tok = served[0].tokenizer
    lengths = [len(ids) for ids in tok.encode_tgt(texts(r.json()))]
    assert max(lengths) <= 3 and min(lengths) >= 1


def test_models(client, runs, served):
    answer = client.get("/models").json()
    assert answer["default"] == "tiny"
    by_name = {m["name"]: m for m in answer["models"]}
    assert list(by_name) == ["tiny", "s2s"]
    for name, path in runs.items():
        payload = checkpoint.load(path / "checkpoints" / "best.pt")
        bleus = [r["bleu"] for r in payload["progress"]["history"] if "bleu" in r]
        m = by_name[name]
        assert m["arch"] == payload["arch"]
        assert (m["src_lang"], m["tgt_lang"]) == ("en", "de")
        assert m["step"] == payload["progress"]["step"]
        assert m["best_valid_bleu"] == pytest.approx(max(bleus))
        assert m["parameters"] == count_parameters(load_model(path, CPU).model)
    assert by_name["tiny"]["step"] == 160 and by_name["tiny"]["attention"] is True
    assert by_name["s2s"]["arch"] == "seq2seq" and by_name["s2s"]["attention"] is False
    assert by_name["tiny"]["max_line_tokens"] == 256  # 2 x data.max_len
    assert by_name["tiny"]["max_output_tokens"] == 312  # 256 x max_len_a + max_len_b, floored


def test_health_docs_and_page(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"ready": True, "models": ["tiny", "s2s"]}
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]
    assert {"text", "model", "beam", "nbest", "max_len"} <= set(body["schema"]["properties"])
    assert "swagger" in client.get("/docs").text.lower()
    page = client.get("/")
    assert page.status_code == 200 and 'id="source"' in page.text
    assert 'fetch("/translate"' in client.get("/static/app.js").text


def test_attention_is_the_picture_of_nmt_translate(client, runs, english, tmp_path):
    """attention: the same PNG as `nmt translate --attention-plot` for the same sentence."""
    r = client.post("/translate", json={"text": english[1], "attention": True, "scores": True})
    assert r.status_code == 200, r.text
    (t,) = r.json()["translations"]
    prefix = "data:image/png;base64,"
    assert t["attention"].startswith(prefix)
    png = base64.b64decode(t["attention"][len(prefix) :])
    assert png[:8] == PNG_MAGIC
    plot = tmp_path / "attention.png"
    cli = ok(nmt_cli("translate", runs["tiny"], "--attention-plot", plot, *FP32, stdin=english[1]))
    assert t["text"] == cli.stdout.strip()
    assert png == plot.read_bytes()


def test_not_ready_while_loading(served, english, alone):
    """Models load in the background: /health answers at once, /ready and /translate say 503
    until they are loaded."""
    release = threading.Event()

    def load():
        release.wait(30)
        return served[:1]

    with TestClient(create_app(load, SETTINGS)) as c:
        assert c.get("/health").status_code == 200
        for method, path in (("GET", "/ready"), ("GET", "/models"), ("POST", "/translate")):
            r = c.request(method, path, json={"text": "A dog."})
            assert r.status_code == 503, path
            assert "loading" in r.json()["error"]
        release.set()
        deadline = time.monotonic() + 30
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert texts(c.post("/translate", json={"text": english[0]}).json()) == [
            alone(english[0])[0]
        ]


def test_a_failing_loader_says_why(served):
    failures = []

    def load():
        raise ValueError("the checkpoint is damaged")

    with TestClient(create_app(load, SETTINGS, on_load_error=failures.append)) as c:
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = c.get("/ready")
        assert r.status_code == 503 and "the checkpoint is damaged" in r.json()["error"]
    assert isinstance(failures[0], ValueError)


# -- bad input: a 4xx JSON answer with one sentence ------------------------------------------------

LONG = " ".join(["A man in a blue shirt is standing on a ladder cleaning windows."] * 25)

BAD = [
    (b"{text", 400, "the body is not valid JSON"),
    (b"\xff\xfe", 400, "the body is not valid JSON"),
    ([1, 2], 422, "the body must be a JSON object"),
    ({}, 422, "field 'text' is required"),
    ({"text": 3}, 422, "field 'text' must be a string or a list of strings"),
    ({"text": ["a", 3]}, 422, "field 'text' must be a string or a list of strings"),
    ({"text": "a", "beam": "5"}, 422, "field 'beam' must be an integer"),
    ({"text": "a", "beam": 2.5}, 422, "field 'beam' must be an integer"),
    ({"text": "a", "scores": "yes"}, 422, "field 'scores' must be true or false"),
    ({"text": "a", "length_penalty": "x"}, 422, "field 'length_penalty' must be a number"),
    ({"text": "a", "sample": True}, 422, "unknown field 'sample'"),
    ({"text": "a", "model": "nope"}, 404, "unknown model 'nope'; this server has: tiny, s2s"),
    ({"text": []}, 422, "field 'text' is an empty list"),
    ({"text": ["a"] * 9}, 413, "9 lines are more than this server's limit of 8"),
    ({"text": ["a", LONG]}, 422, "line 2 has"),
    ({"text": "a\nb"}, 422, "line 1 holds a line break"),
    ({"text": "a", "beam": 0}, 422, "invalid value for decode.beam: must be >= 1"),
    ({"text": "a", "beam": 2, "nbest": 3}, 422, "invalid value for decode.nbest"),
    ({"text": "a", "beam": 100}, 422, "beam 100 is larger than this server's limit of 32"),
    ({"text": "a", "max_len": 0}, 422, "max_len must be >= 1"),
    ({"text": "a", "max_len": 5, "max_len_b": 3}, 422, "not both"),
    ({"text": "a", "length_penalty": -1}, 422, "invalid value for decode.length_penalty"),
    ({"text": "a", "patience": 0}, 422, "invalid value for decode.patience"),
    (b'{"text": "a", "patience": 1e400}', 422, "invalid value for decode.patience"),  # inf
    ({"text": "a", "max_len_a": 1e300}, 422, "invalid value for decode.max_len_a"),
    ({"text": "a", "max_len": 10**6}, 422, "max_len 1000000 is above this server's limit of"),
    ({"text": "a", "max_len_b": 10**5}, 422, "is 100307, above this server's limit of 312"),
    (b'{"text": "\\ud800 dog"}', 422, "line 1 is not valid Unicode"),
    (b'{"text": "a", "model": "\\ud800"}', 422, "field 'model' is not valid Unicode"),
    (b"[" * 2000 + b"]" * 2000, 400, "nested too deeply"),
    ({"text": ["a", "b"], "attention": True}, 422, "attention is drawn for one non-empty line"),
    ({"text": "a", "model": "s2s", "attention": True}, 422, "has no attention"),
    ({"text": "a " * 3000}, 413, "larger than this server's limit of 4,096 bytes"),
]


def error_of(r: httpx.Response) -> str:
    """A 4xx answer: JSON {"error": one sentence}."""
    assert 400 <= r.status_code < 500, r.text
    body = r.json()
    assert list(body) == ["error"]
    message = body["error"]
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("body, status, fragment", BAD, ids=[str(b)[:40] for b, _, _ in BAD])
def test_bad_input(client, body, status, fragment):
    if isinstance(body, bytes):
        r = client.post("/translate", content=body, headers={"content-type": "application/json"})
    else:
        r = client.post("/translate", json=body)
    assert r.status_code == status, r.text
    assert fragment in error_of(r)


def test_bad_input_details(client, english, alone):
    # a line over the limit names its length and the limit
    message = error_of(client.post("/translate", json={"text": ["a", LONG]}))
    assert "more than model tiny's limit of 256" in message

    # a body streamed without Content-Length is counted as it comes
    def streamed():
        yield b'{"text": "'
        for _ in range(10):
            yield b"a " * 500
        yield b'"}'

    r = client.post("/translate", content=streamed())
    assert r.status_code == 413 and "larger than" in error_of(r)
    # unknown paths and methods answer in JSON too
    assert "no such endpoint" in error_of(client.get("/nowhere"))
    assert "GET is not allowed" in error_of(client.get("/translate"))
    # JSON sent without a JSON content type (curl -d) is read all the same
    r = client.post("/translate", content=json.dumps({"text": english[0]}))
    assert texts(r.json()) == [alone(english[0])[0]]


# -- batching, in process --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def async_client(app):
    """An httpx client on the app in this event loop, with the app's startup and shutdown."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://nmt") as c:
            yield c


def test_concurrent_requests_share_batches_and_keep_their_order(served, english, alone):
    """Requests arriving within max-wait-ms are decoded in one batch (counted), and each gets
    its own translations in its own order, as if translated alone."""
    app = create_app(served, ServeSettings(max_wait_ms=300, workers=1))
    requests = [english[0:3][::-1], english[3], english[4:6], [english[6], "", english[7]]]

    async def run():
        async with async_client(app) as c:
            answers = await asyncio.gather(
                *(c.post("/translate", json={"text": t, "scores": True}) for t in requests)
            )
            stats = (await c.get("/stats")).json()
            return [a.json() for a in answers], stats

    answers, stats = asyncio.run(run())
    assert stats["requests"] == 4 and stats["sentences"] == 8
    assert stats["batches"] == 1 and stats["combined_batches"] == 1
    for text, answer in zip(requests, answers):
        lines = [text] if isinstance(text, str) else text
        for line, got in zip(lines, answer["translations"], strict=True):
            if line:
                assert (got["text"], pytest.approx(got["score"], abs=1e-5)) == alone(line)
            else:
                assert got == {"text": "", "score": None}


def test_a_lone_request_does_not_wait_the_whole_gathering_time(served, english, alone):
    """A batch starts once nothing has arrived for a fifth of --max-wait-ms: one request is
    answered long before the 4 s it would otherwise wait for company."""
    app = create_app(served, ServeSettings(max_wait_ms=4000, workers=1))

    async def run():
        async with async_client(app) as c:
            t0 = time.perf_counter()
            r = await c.post("/translate", json={"text": english[0]})
            return r.json(), time.perf_counter() - t0

    answer, seconds = asyncio.run(run())
    assert texts(answer) == [alone(english[0])[0]]
    assert 0.8 <= seconds < 3.0  # the 0.8 s quiet gap, then the decode


def test_two_idle_threads_share_what_is_waiting(served, english, alone):
    """8 sentences waiting and 2 idle decoding threads: 2 batches of 4 decoded at once, not
    one of 8 beside an idle core."""
    app = create_app(served, ServeSettings(max_wait_ms=300, workers=2))

    async def run():
        async with async_client(app) as c:
            answers = await asyncio.gather(
                *(c.post("/translate", json={"text": line}) for line in english[:8])
            )
            return [a.json() for a in answers], (await c.get("/stats")).json()

    answers, stats = asyncio.run(run())
    assert [texts(a) for a in answers] == [[alone(line)[0]] for line in english[:8]]
    assert stats["batches"] == 2 and stats["largest_batch"] == 4


def test_a_long_request_does_not_hold_short_ones_back(served, english, alone):
    """With room for 4 of the longest sentences in the running batch, a short request sent
    after a long one takes the first place a sentence leaves free (before the long request's
    next sentences): it is answered within two sentences' worth of decoding steps, while the
    long one is still being decoded."""
    beam = served[0].config.decode.beam
    longest = max(len(ids) for ids in served[0].tokenizer.encode_src(english)) + 1
    budget = 4 * longest * beam
    opts = search_options(served[0].config.decode)
    steps = int(opts.max_len_a * longest + opts.max_len_b)  # the most a sentence takes
    app = create_app(served, ServeSettings(max_batch_tokens=budget, max_wait_ms=0, workers=1))
    finished: list[str] = []

    async def run():
        async with async_client(app) as c:
            stats = app.state.nmt.batcher.stats

            async def send(name: str, text, delay: float):
                await asyncio.sleep(delay)
                before = stats.steps
                r = await c.post("/translate", json={"text": text})
                finished.append(name)
                return r.json(), stats.steps - before

            answers = await asyncio.gather(
                send("long", english[:40], 0), send("short", english[0], 0.05)
            )
            return (*answers, stats.joined)

    (long_answer, long_steps), (short_answer, short_steps), joined = asyncio.run(run())
    assert finished == ["short", "long"]
    assert joined > 20  # most sentences joined others half-way through their translation
    assert texts(short_answer) == [alone(english[0])[0]]
    assert texts(long_answer) == [alone(line)[0] for line in english[:40]]
    assert short_steps <= 2 * steps < long_steps


class Gated:
    """An engine whose streams step only when the test lets them (`go`), and note which
    lines joined at each step (`joins`: step number -> the lines added before it)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.permits = threading.Semaphore(0)
        self.entered = threading.Condition()
        self.steps = 0
        self.joins: dict[int, list[str]] = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, opts):
        return GatedStream(self.engine.stream(opts), self)

    def wait_for_step(self, n: int) -> None:
        """Until the decoding thread has begun step n (and waits for its permit)."""
        with self.entered:
            assert self.entered.wait_for(lambda: self.steps >= n, timeout=60)

    def go(self, steps: int = 1) -> None:
        self.permits.release(steps)


class GatedStream:
    def __init__(self, stream, gate: Gated) -> None:
        self.stream, self.gate, self.added = stream, gate, []

    def __len__(self) -> int:
        return len(self.stream)

    def add(self, lines, ids) -> None:
        self.added += lines
        self.stream.add(lines, ids)

    def step(self):
        gate = self.gate
        with gate.entered:
            gate.steps += 1
            if self.added:
                gate.joins[gate.steps], self.added = self.added, []
            gate.entered.notify_all()
        assert gate.permits.acquire(timeout=60)
        return self.stream.step()


def test_a_client_that_goes_away_cancels_its_request(served, english, monkeypatch):
    """uvicorn does not cancel a request's task when its client closes the connection: the
    request itself notices (within GONE_POLL_S), cancels its job in the batcher (what is
    still queued is dropped, not decoded for nobody) and ends with a 499, though its
    sentences are still being decoded (held here at their first step)."""
    gate = Gated(served[0].engine)
    tiny = dataclasses.replace(served[0], engine=gate)
    cancelled = []
    cancel = Batcher.cancel

    def recording(self, job) -> None:
        cancelled.append(job)
        cancel(self, job)

    monkeypatch.setattr(Batcher, "cancel", recording)
    body = json.dumps({"text": english[:4]}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/translate",
        "raw_path": b"/translate",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    app = create_app([tiny], SETTINGS)
    with TestClient(app) as c:

        async def ask_then_leave() -> tuple[list[dict], float]:
            import anyio

            messages = [{"type": "http.request", "body": body, "more_body": False}]
            sent: list[dict] = []
            left = None

            async def receive() -> dict:
                nonlocal left
                if messages:
                    return messages.pop(0)
                while gate.steps < 1:  # it leaves once its sentences are being decoded
                    await anyio.sleep(0.01)
                left = left or time.monotonic()
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            with anyio.fail_after(30):  # without noticing, it would wait for the gate
                await app(scope, receive, send)
            return sent, time.monotonic() - left

        try:
            sent, after = c.portal.call(ask_then_leave)
        finally:
            gate.go(10_000)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert len(cancelled) == 1 and cancelled[0].cancelled
    assert after < 5 * GONE_POLL_S


def test_a_running_batch_takes_a_lone_newcomer_a_step_later_with_company(served, english, alone):
    """A sentence that arrives alone while a batch decodes waits one step (not more) before it
    joins; two that arrive together join at the next step, together. Each is translated as
    it would be alone."""
    gate = Gated(served[0].engine)
    tiny = dataclasses.replace(served[0], engine=gate)
    opts = search_options(tiny.config.decode)
    batcher = Batcher(None, 0, workers=1).start()
    answers: dict[str, threading.Event] = {}
    results: dict[str, list] = {}

    def submit(name: str, lines: list[str]) -> None:
        answers[name] = threading.Event()
        lengths = [len(ids) for ids in tiny.tokenizer.encode_src(lines)]

        def done(res, err) -> None:
            results[name] = res if err is None else err
            answers[name].set()

        batcher.submit(tiny, opts, lines, lengths, done)

    try:
        submit("first", english[:4])
        gate.wait_for_step(1)
        submit("lone", [english[4]])  # arrives during step 1
        gate.go()
        gate.wait_for_step(2)
        assert batcher.stats.held == 1  # step 2 ran without it
        gate.go()
        gate.wait_for_step(3)
        submit("pair-a", [english[5]])  # two arrive during step 3
        submit("pair-b", [english[6]])
        gate.go()
        gate.wait_for_step(4)
        gate.go(10_000)
        for name, answered in answers.items():
            assert answered.wait(60), name
    finally:
        gate.go(10_000)
        batcher.close()
    assert sorted(gate.joins[1]) == sorted(english[:4])  # shortest first
    assert gate.joins[3] == [english[4]]  # a step late, not two
    assert sorted(gate.joins[4]) == sorted(english[5:7])  # together, at once
    assert batcher.stats.held == 1
    asked = {
        "first": english[:4],
        "lone": [english[4]],
        "pair-a": [english[5]],
        "pair-b": [english[6]],
    }
    for name, lines in asked.items():
        assert [nbest[0][0] for nbest in results[name]] == [alone(line)[0] for line in lines]


class Poisoned:
    """An engine that fails on one line: a decoding error inside a batch of others, at the
    step after the line joined it (or, decoding the line alone, at once)."""

    def __init__(self, engine, poison: str) -> None:
        self.engine, self.poison = engine, poison

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def translate(self, lines, opts, **kwargs):
        if self.poison in lines:
            raise RuntimeError(f"cannot decode {self.poison!r}")
        return self.engine.translate(lines, opts, **kwargs)

    def stream(self, opts):
        return PoisonedStream(self.engine.stream(opts), self.poison)


class PoisonedStream:
    def __init__(self, stream, poison: str) -> None:
        self.stream, self.poison, self.poisoned = stream, poison, False

    def __len__(self) -> int:
        return len(self.stream)

    def add(self, lines, ids) -> None:
        self.poisoned = self.poisoned or self.poison in lines
        self.stream.add(lines, ids)

    def step(self):
        if self.poisoned:
            raise RuntimeError(f"cannot decode {self.poison!r}")
        return self.stream.step()


def test_a_decoding_error_fails_its_request_alone(served, english, alone, caplog):
    poison = english[9]
    tiny = dataclasses.replace(served[0], engine=Poisoned(served[0].engine, poison))
    app = create_app([tiny], ServeSettings(max_wait_ms=300, workers=1))
    requests = [english[0], [english[1], poison], english[2:4]]

    async def run():
        async with async_client(app) as c:
            first = await asyncio.gather(
                *(c.post("/translate", json={"text": t}) for t in requests)
            )
            after = await c.post("/translate", json={"text": english[5]})
            return first, after, (await c.get("/stats")).json()

    with caplog.at_level(logging.ERROR, logger="nmt.serve"):
        (good1, bad, good2), after, stats = asyncio.run(run())
    assert bad.status_code == 500
    assert bad.json() == {
        "error": "decoding this request failed; the server's log has the traceback"
    }
    assert texts(good1.json()) == [alone(english[0])[0]]
    assert texts(good2.json()) == [alone(line)[0] for line in english[2:4]]
    assert texts(after.json()) == [alone(english[5])[0]]
    assert stats["failed_requests"] == 1
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Traceback" in logged and f"cannot decode {poison!r}" in logged


class JoinsLate(Poisoned):
    """An engine whose streams keep added lines until the step, as a decoding process's do
    (`RemoteStream`), and cannot take one line: that step raises `JoinError`, having added
    none of them; the lines decoded alone (`translate`) are noted."""

    def __init__(self, engine, poison: str) -> None:
        super().__init__(engine, poison)
        self.alone: list[str] = []

    def translate(self, lines, opts, **kwargs):
        self.alone += lines
        return super().translate(lines, opts, **kwargs)

    def stream(self, opts):
        return JoiningStream(self.engine.stream(opts), self.poison)


class JoiningStream:
    def __init__(self, stream, poison: str) -> None:
        self.stream, self.poison, self.waiting = stream, poison, ([], [])

    def __len__(self) -> int:
        return len(self.stream) + len(self.waiting[0])

    def add(self, lines, ids) -> None:
        self.waiting[0].extend(lines)
        self.waiting[1].extend(ids)

    def step(self):
        (lines, ids), self.waiting = self.waiting, ([], [])
        if self.poison in lines:
            raise JoinError(f"cannot take {self.poison!r}")
        if lines:
            self.stream.add(lines, ids)
        return self.stream.step()


def test_lines_that_cannot_join_fail_their_request_and_the_batch_decodes_on(
    served, english, alone, caplog
):
    """A running batch in a stream that adds lines at the step (a decoding process's): when
    the newcomers cannot join, their requests are decoded again alone (the one that fails
    fails alone) and the sentences already decoding go on in the batch, not decoded again.
    The batch's first step waits (`Gated`) until both late requests are queued, so that they
    join together at the next step."""
    poison = english[9]
    gate = Gated(served[0].engine)
    engine = JoinsLate(gate, poison)
    tiny = dataclasses.replace(served[0], engine=engine)
    app = create_app([tiny], ServeSettings(max_wait_ms=0, workers=1))

    async def run():
        async with async_client(app) as c:
            stats = app.state.nmt.batcher.stats
            try:
                first = asyncio.ensure_future(c.post("/translate", json={"text": english[:6]}))
                while gate.steps == 0:  # decoding: the next ones join it
                    await asyncio.sleep(0.001)
                late = [
                    asyncio.ensure_future(
                        c.post("/translate", json={"text": [english[10], poison]})
                    ),
                    asyncio.ensure_future(c.post("/translate", json={"text": english[11]})),
                ]
                while stats.requests < 3:
                    await asyncio.sleep(0.001)
            finally:
                gate.go(10_000)
            return await first, *await asyncio.gather(*late), stats.failed_requests

    with caplog.at_level(logging.ERROR, logger="nmt.serve"):
        first, bad, good, failed = asyncio.run(run())
    assert texts(first.json()) == [alone(line)[0] for line in english[:6]]
    assert bad.status_code == 500 and failed == 1
    assert texts(good.json()) == [alone(english[11])[0]]
    assert not set(english[:6]) & set(engine.alone)  # the batch decoded on: none again alone
    assert poison in engine.alone
    assert f"cannot take {poison!r}" in "\n".join(r.getMessage() for r in caplog.records)


def decoding_children(pid: int) -> set[int]:
    """The decoding processes of process `pid`: its children started by multiprocessing's
    spawn (not its resource tracker)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.add(int(entry.name))
    return found


def test_decoding_processes_translate_as_the_threads_do(served, english, alone):
    """processes=True: each decoding thread searches in a child process of its own, which
    loaded both models; concurrent requests get the translations and scores of the search in
    this process. A child killed between requests is replaced at its thread's next batch,
    and closing the server ends the children."""
    app = create_app(served, ServeSettings(max_wait_ms=100, workers=2, processes=True))
    requests = [{"text": line, "scores": True} for line in english[:6]]
    requests += [{"text": english[6:9], "model": "s2s"}, {"text": english[9], "beam": 2}]

    async def send_all(c):
        answers = await asyncio.gather(*(c.post("/translate", json=r) for r in requests))
        return [a.json() for a in answers]

    def check(answers) -> None:
        for request, answer in zip(requests[:6], answers):
            (got,) = answer["translations"]
            assert (got["text"], pytest.approx(got["score"], abs=1e-5)) == alone(request["text"])
        assert texts(answers[6]) == texts(client_answers[0])
        assert texts(answers[7]) == [alone(english[9], beam=2)[0]]

    with TestClient(create_app(served, SETTINGS)) as c:  # threads: the s2s model's answer
        client_answers = [c.post("/translate", json=requests[6]).json()]

    async def run():
        async with async_client(app) as c:
            processes = app.state.nmt.batcher.processes
            pids = [p.pid for p in processes]
            assert len(set(pids)) == 2 and set(pids) <= decoding_children(os.getpid())
            assert all(set(p.loads) == {"tiny", "s2s"} for p in processes)
            check(await send_all(c))
            os.kill(pids[0], signal.SIGKILL)
            while processes[0].alive():
                await asyncio.sleep(0.01)
            check(await send_all(c))  # both threads take sentences: the dead child's too
            pids += [p.pid for p in processes]  # the new child
            stats = (await c.get("/stats")).json()
            return processes, pids, stats

    processes, pids, stats = asyncio.run(run())
    assert [p.started for p in processes] == [2, 1] and len(set(pids)) == 3
    assert stats["failed_requests"] == 0 and stats["batches"] >= 4
    assert not decoding_children(os.getpid()) & set(pids)  # closed with the app


def test_a_thread_whose_child_cannot_start_again_decodes_by_itself(served, english, alone, caplog):
    """A child that died and cannot be started again (here: the checkpoint it would load is
    not the server's any more): its thread logs why and decodes in the server's process."""
    app = create_app(served[:1], ServeSettings(max_wait_ms=0, workers=1, processes=True))

    async def run():
        async with async_client(app) as c:
            (process,) = app.state.nmt.batcher.processes
            first = await c.post("/translate", json={"text": english[0]})
            load = process.loads["tiny"]
            process.loads["tiny"] = dataclasses.replace(load, fingerprint="saved again")
            os.kill(process.pid, signal.SIGKILL)
            while process.alive():
                await asyncio.sleep(0.01)
            second = await c.post("/translate", json={"text": english[1]})
            third = await c.post("/translate", json={"text": english[2]})
            return [texts(r.json()) for r in (first, second, third)], process

    with caplog.at_level(logging.ERROR, logger="nmt.serve"):
        answers, process = asyncio.run(run())
    assert answers == [[alone(line)[0]] for line in english[:3]]
    assert process.started == 2  # one attempt, not one per batch
    (record,) = [r for r in caplog.records if "decodes in the server's process" in r.getMessage()]
    assert "changed after the server (or command) loaded them" in record.getMessage()


@contextlib.contextmanager
def tiny_decoding_process(served):
    """A decoding process (1 thread) of the served tiny model, its `Load` and the model's
    search options; closed at the end."""
    load = Load.of("tiny", served[0].engine)
    process = DecodeProcess([load], threads=1).start()
    try:
        yield process, load, search_options(served[0].config.decode)
    finally:
        process.close()


def test_a_decoding_process_reports_its_errors(runs, served):
    """The child's errors are raised in the caller with its traceback, and leave its other
    running batches as they were; lines that cannot join a batch leave it as it was (the
    step that brought them raises `JoinError`, and the next one steps the others); a killed
    child fails its batches and is replaced; a model that is not the one the server loaded
    (its checkpoint was saved again meanwhile) stops the child at once with the reason."""
    with tiny_decoding_process(served) as (process, load, opts):
        stream = process.stream("tiny", opts)
        stream.add(["A dog runs."], [7])
        sampling = process.stream("tiny", dataclasses.replace(opts, sample=True))
        sampling.add(["a"], [8])  # kept until its step
        assert len(sampling) == 1
        with pytest.raises(JoinError, match="a stream searches") as e:
            sampling.step()
        assert "in the decoding process:\nTraceback" in str(e.value) and len(sampling) == 0
        unknown = process.stream("nope", opts)
        unknown.add(["a"], [9])
        with pytest.raises(JoinError, match="KeyError: 'nope'"):
            unknown.step()
        assert stream.step() == []  # the first step of "A dog runs.": it joins, nothing ends
        stream.add([None], [10])  # not text: the child cannot tokenize it, it does not join
        with pytest.raises(JoinError):
            stream.step()
        assert len(stream) == 1  # "A dog runs." decodes on
        ended = []
        while len(stream):
            ended += stream.step()
        (sid, nbest), *rest = ended
        assert (sid, rest) == (7, []) and nbest[0][0] == served[0].engine.translate(
            ["A dog runs."], opts, batch_tokens=1000
        )[0][0][0]
        # a child that dies: its batches fail, the next stream starts a new child, and a
        # batch of the dead one fails instead of stepping an empty batch in the new one
        other = process.stream("tiny", dataclasses.replace(opts, beam=2))
        stream.add(["A dog runs."], [1])
        other.add(["Two cats sleep."], [2])
        os.kill(process.pid, signal.SIGKILL)
        while process.alive():
            time.sleep(0.01)
        with pytest.raises(DecodeProcessError, match=r"ended \(exit code -9\)"):
            stream.step()
        again = process.stream("tiny", opts)
        with pytest.raises(DecodeProcessError, match="has ended; its sentences are lost"):
            other.step()
        again.add(["A dog runs."], [3])
        ended = []
        while len(again):
            ended += again.step()
        assert process.started == 2 and [(i, n[0][0]) for i, n in ended] == [(3, nbest[0][0])]
    assert not process.alive()
    stale = dataclasses.replace(load, fingerprint="another checkpoint")
    with pytest.raises(
        DecodeProcessError, match=r"changed after the server \(or command\) loaded them"
    ):
        DecodeProcess([stale], threads=1).start()


def gone(pid: int) -> bool:
    """No process `pid` (ended and reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_silent_decoding_process_is_killed_and_replaced(runs, served, monkeypatch):
    """A child alive but silent (stopped here; a deadlocked one alike) is not waited on for
    ever: past ANSWER_TIMEOUT_S the request fails with `DecodeProcessError`, the child is
    killed and the next stream starts a new one. A wait for a child's exit that is
    interrupted (a second Ctrl-C while the server exits) still kills the child."""
    monkeypatch.setattr(decode_process, "ANSWER_TIMEOUT_S", 1.0)
    with tiny_decoding_process(served) as (process, _, opts):
        stream = process.stream("tiny", opts)
        stream.add(["A dog runs."], [1])
        pid = process.pid
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(DecodeProcessError, match=r"answered nothing for 1 s and was killed"):
            stream.step()
        assert 1.0 <= time.monotonic() - started < 10 and gone(pid)
        again = process.stream("tiny", opts)
        again.add(["A dog runs."], [2])
        ended = []
        while len(again):
            ended += again.step()
        assert process.started == 2 and [i for i, _ in ended] == [2]

        pid = process.pid
        os.kill(pid, signal.SIGSTOP)  # it cannot exit when asked
        join = multiprocessing.process.BaseProcess.join

        def interrupted(self, timeout=None):
            if timeout is not None:
                raise KeyboardInterrupt
            return join(self, timeout)

        monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", interrupted)
        with pytest.raises(KeyboardInterrupt):
            process.close(timeout=10)
        assert gone(pid)


# -- a real uvicorn process ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 30) -> httpx.Response:
    return httpx.get(url, timeout=timeout)


@contextlib.contextmanager
def nmt_server(*args, ready: bool = True, within: float = 120):
    """`nmt serve ARGS --port P` in a subprocess: (process, base URL) once /ready says 200
    (in `within` seconds)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nmt", "serve", *map(str, args), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
        start_new_session=True,  # its own process group, as a service manager starts it
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + within
        while ready:
            assert proc.poll() is None, proc.communicate()[1]
            with contextlib.suppress(httpx.TransportError):
                if get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"the server was not ready in {within} s"
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def server(runs):
    with nmt_server(
        f"tiny={runs['tiny']}",
        f"s2s={runs['s2s']}",
        *FP32,
        "--max-lines",
        "8",
        "--max-wait-ms",
        "150",  # the clients of a test arrive within it, even on a busy machine
    ) as (proc, url):
        yield url


def post_all(url: str, bodies: list, delays: list[float] | None = None) -> list[httpx.Response]:
    """Each body POSTed to /translate by its own thread, all at once (or `delays[i]` seconds
    after the others started)."""
    answers: list = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def send(i: int) -> None:
        with httpx.Client(timeout=120) as c:
            barrier.wait()
            time.sleep(delays[i] if delays else 0)
            if isinstance(bodies[i], bytes):
                answers[i] = c.post(f"{url}/translate", content=bodies[i])
            else:
                answers[i] = c.post(f"{url}/translate", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def test_real_server_endpoints(server, client, english):
    assert get(f"{server}/health").json() == {"status": "ok"}
    assert get(f"{server}/models").json() == client.get("/models").json()
    body = {"text": english[:4], "scores": True, "beam": 2}
    r = httpx.post(f"{server}/translate", json=body, timeout=60)
    # the same texts and scores; the batch a sentence joins depends on the threads' timing,
    # and fp32 scores on the batch, in their last bits
    got, expected = r.json(), client.post("/translate", json=body).json()
    assert texts(got) == texts(expected) and got["model"] == expected["model"]
    scores = [t["score"] for t in expected["translations"]]
    assert [t["score"] for t in got["translations"]] == pytest.approx(scores, abs=1e-5)
    assert 'id="source"' in get(server).text
    assert "/translate" in get(f"{server}/openapi.json").json()["paths"]


def test_real_server_batches_concurrent_clients_amid_bad_ones(server, english, alone):
    """16 clients at once, each one sentence, among 8 bad requests: every good one gets its
    own translation, every bad one its 4xx, and the sentences share batches."""
    before = get(f"{server}/stats").json()
    good = [{"text": line} for line in english[:16]]
    bad = [b"{text", {"text": []}, {"text": "a", "beam": "x"}, {"text": ["a"] * 9}]
    bad += [{"text": "a", "model": "nope"}, {"text": LONG}, {"text": "a", "beam": 0}, [1]]
    order = list(range(len(good) + len(bad)))
    random.Random(0).shuffle(order)
    bodies = [(good + bad)[i] for i in order]
    answers = dict(zip(order, post_all(server, bodies)))
    for i in range(len(good)):
        assert answers[i].status_code == 200, answers[i].text
        assert texts(answers[i].json()) == [alone(english[i])[0]]
    for i in range(len(good), len(good) + len(bad)):
        error_of(answers[i])
    after = get(f"{server}/stats").json()
    assert after["sentences"] - before["sentences"] == 16
    assert after["batches"] - before["batches"] < 16  # some requests were decoded together
    assert after["combined_batches"] > before["combined_batches"]


def test_sigterm_answers_the_requests_in_flight_and_exits_0(runs, english, alone):
    """SIGTERM to the server's process group (as a service manager sends it) while 8 requests
    wait in the queue (for 3 s, --max-wait-ms): new connections are refused at once, each of
    the 8 still gets its translation from the decoding process, which ignored the signal, the
    server exits 0 and its decoding process with it."""
    with nmt_server(runs["tiny"], *FP32, "--max-wait-ms", "3000", "--workers", "1") as (proc, url):
        (child,) = decoding_children(proc.pid)
        results: list = []
        threads = [
            threading.Thread(
                target=lambda line=line: results.append(
                    httpx.post(f"{url}/translate", json={"text": line}, timeout=60)
                )
            )
            for line in english[:8]
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while get(f"{url}/stats").json()["queued_sentences"] < 8:  # all 8 in the queue
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        # no longer accepting: refused, or (caught while the listening socket closes)
        # accepted by the kernel and dropped unanswered
        with pytest.raises((httpx.NetworkError, httpx.RemoteProtocolError)):
            while time.monotonic() < deadline:
                httpx.get(f"{url}/health", timeout=5)
                time.sleep(0.02)
        assert not results  # ...while the 8 requests still wait for their batch
        assert decoding_children(proc.pid) == {child}  # alive: it ignored the signal
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        stderr = proc.stderr.read()
    assert "Traceback" not in stderr
    assert "1 decoding thread(s), each searching in its own process" in stderr
    assert "starting a new one" not in stderr and "decodes in the server's process" not in stderr
    assert not Path(f"/proc/{child}").exists()
    assert sorted(texts(r.json())[0] for r in results) == sorted(
        alone(line)[0] for line in english[:8]
    )


def test_serve_with_ctranslate2(runs, english):
    """`nmt serve --engine ctranslate2 --quantization int8 --length-norm plain`: the run's
    CTranslate2 export answers as `nmt translate --engine ctranslate2` does, through the same
    batching queue; /models names the engine; attention and the search settings CTranslate2
    cannot honour are refused with the reason; default settings it cannot honour stop the
    command with one line."""
    pytest.importorskip("ctranslate2")
    lines = english[:6]
    ct2 = ("--engine", "ctranslate2", "--quantization", "int8", "--length-norm", "plain")
    expected = ok(
        nmt_cli("translate", runs["tiny"], *ct2, "--workers", "1", stdin="\n".join(lines) + "\n")
    ).stdout.splitlines()
    with nmt_server(runs["tiny"], *ct2, "--max-wait-ms", "200") as (proc, url):
        with httpx.Client(base_url=url, timeout=60) as c:
            models = c.get("/models").json()["models"]
            answers = [c.post("/translate", json={"text": line}).json() for line in lines]
            together = c.post("/translate", json={"text": lines}).json()
            no_attention = c.post("/translate", json={"text": lines[0], "attention": True})
            gnmt = c.post("/translate", json={"text": lines[0], "length_norm": "gnmt"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    (m,) = models
    assert (m["engine"], m["precision"], m["attention"]) == ("ctranslate2", "int8", False)
    assert m["step"] == 160 and m["parameters"] == count_parameters(
        load_model(runs["tiny"], CPU).model
    )
    assert [texts(a)[0] for a in answers] == expected == texts(together)
    assert no_attention.status_code == 422
    assert "serve it with --engine nmt" in no_attention.json()["error"]
    assert gnmt.status_code == 422 and "length_norm=gnmt" in gnmt.json()["error"]
    # found once the model is loaded, after the server started: it stops, one error line
    with nmt_server(f"tiny={runs['tiny']}", "--engine", "ctranslate2", ready=False) as (p, _):
        _, stderr = p.communicate(timeout=120)
    assert p.returncode == 2 and "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: model tiny: decode.length_norm=gnmt")
    assert "--length-norm plain" in last


def test_a_default_beam_above_the_servers_limit_is_refused_when_loading(runs):
    """Served with a default beam above what a request may ask for, every request that did
    not ask for a beam was refused (422) and nmt serve had no option to lower it: --beam."""
    with pytest.raises(NMTError, match="decodes with beam 40 by default, above the 32 a request"):
        load_served(ModelSpec("tiny", runs["tiny"]), CPU, "fp32", beam=40)
    served = load_served(ModelSpec("tiny", runs["tiny"]), CPU, "fp32", beam=2)
    assert (served.info["beam"], served.info["nbest"]) == (2, 1)
    assert served.options(DecodeRequest(), 32).beam == 2


# -- the command's own errors: one line, exit 2 ------------------------------------------------------


def test_serve_command_errors(runs, tmp_path):
    missing = tmp_path / "nowhere"
    assert f"no such run directory or checkpoint: {missing}" in one_line_error(
        nmt_cli("serve", missing)
    )
    assert "--max-wait-ms must be >= 0" in one_line_error(
        nmt_cli("serve", runs["tiny"], "--max-wait-ms", "-1")
    )
    assert "unknown precision 'fp64'" in one_line_error(
        nmt_cli("serve", runs["tiny"], "--precision", "fp64")
    )
    assert "drop --threads" in one_line_error(
        nmt_cli("serve", runs["tiny"], "--compile", "--threads")
    )
    # refused before the server starts (no log lines before it), not when the model loads
    assert "not int8's quantized kernels" in one_line_error(
        nmt_cli("serve", runs["tiny"], "--compile", "--precision", "int8")
    )
    assert "two models are called 'x'" in one_line_error(
        nmt_cli("serve", f"x={runs['tiny']}", f"x={runs['s2s']}")
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = one_line_error(nmt_cli("serve", runs["tiny"], "--port", port))
    assert f"cannot listen on 127.0.0.1:{port}" in message and "choose another --port" in message


def test_serve_a_corrupt_checkpoint(runs, tmp_path):
    """Found while loading, after the server started: it stops, one error line, exit 2."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(runs["tiny"], copy, ignore=shutil.ignore_patterns("step-*.pt", "translations"))
    (copy / "checkpoints" / "best.pt").write_bytes(b"this is not a checkpoint\n" * 100)
    with nmt_server(copy, ready=False) as (proc, _):
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(copy / "checkpoints" / "best.pt") in last


def test_without_the_serve_extra(runs):
    """No fastapi: one line naming the pip command; other commands never import it."""
    code = (
        "import sys; sys.modules['fastapi'] = None; sys.argv = ['nmt', 'serve', sys.argv[1]]; "
        "import nmt.cli; nmt.cli.main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(runs["tiny"])], capture_output=True, text=True, timeout=120
    )
    assert "pip install 'nmt[serve]'" in one_line_error(result)
    probe = "import sys, nmt.cli; print(sorted({'fastapi', 'uvicorn'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- the page in a real browser ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Debian's Chromium, headless, driven by Playwright (its own browser downloads are not
    used), with a fresh profile and no background connections."""
    if not CHROMIUM.is_file():
        pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium; .ci/run does)")
    playwright = pytest.importorskip("playwright.sync_api", reason="the dev extra's playwright")
    with playwright.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=str(CHROMIUM),
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield context
        context.close()


def test_the_page_translates_and_draws_the_attention(browser, server, english, alone, tmp_path):
    page = browser.new_page()
    page.goto(server)
    page.wait_for_selector("#translate:not([disabled])", timeout=30_000)
    assert page.input_value("#beam") == "3"  # the model's decode.beam
    page.fill("#source", english[2])
    page.click("#translate")
    page.wait_for_selector("#output .translation", timeout=30_000)
    assert page.inner_text("#output .translation") == alone(english[2])[0]
    assert page.inner_text("#output .score").startswith("score -")
    image = page.wait_for_selector("#heatmap img", timeout=30_000)
    assert page.evaluate("(img) => img.complete && img.naturalWidth > 100", image)
    page.screenshot(path=str(tmp_path / "page.png"), full_page=True)

    # n-best on request; the model without attention says so
    page.select_option("#model", "s2s")
    page.fill("#beam", "3")
    page.fill("#nbest", "3")
    page.click("#translate")
    page.wait_for_selector("#output ol.nbest li:nth-child(3)", timeout=30_000)
    assert "has no attention" in page.inner_text("#heatmap")
    assert page.query_selector("#heatmap img") is None

    # an error from the server is shown, not thrown (beam 0 the form itself refuses)
    page.fill("#beam", "2")
    page.click("#translate")
    page.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "decode.nbest" in page.inner_text("#error")
    # ... and nothing of the last answer stays under it (the n-best list did)
    assert page.inner_text("#output") == "" and page.inner_text("#heatmap") == ""

    # the page sends the box's non-empty lines: a message names the line as the box numbers it
    page.fill("#nbest", "1")
    page.fill("#source", "A dog runs .\n\n" + "word " * 300)
    page.click("#translate")
    page.wait_for_function("document.getElementById('error').textContent.includes('tokens')")
    assert page.inner_text("#error").startswith("line 3 has "), page.inner_text("#error")
    page.close()


def test_compile_is_checked_by_the_server_and_done_by_its_children(runs, served):
    """`nmt serve --compile`: the server checks that its decoding processes can compile the
    model before it starts them (a seq2seq cannot, nor int8 decoding, nor the CTranslate2
    engine, nor searches in the server's threads), and hands them the compiling with the
    model's default search settings to warm up with."""
    with pytest.raises(NMTError, match="seq2seq decodes as it is"):
        load_served(ModelSpec("s2s", runs["s2s"]), CPU, "fp32", compiled_in_child=True)
    with pytest.raises(NMTError, match="not int8"):
        load_served(ModelSpec("tiny", runs["tiny"]), CPU, "int8", compiled_in_child=True)
    opts = search_options(served[0].config.decode)
    plain, compiled = Load.of("tiny", served[0].engine), Load.of("tiny", served[0].engine, opts)
    assert (plain.compile, plain.warm_up) == (False, None)
    assert (compiled.compile, compiled.warm_up) == (True, opts)
    settings = ServeSettings(compile=True, processes=True)
    with pytest.raises(NMTError, match="nmt's own decoding"):
        serve([ModelSpec("tiny", runs["tiny"])], settings, "127.0.0.1", 0, CPU, None, "ctranslate2")
    threads = ServeSettings(compile=True)
    with pytest.raises(NMTError, match="drop --threads"):
        serve([ModelSpec("tiny", runs["tiny"])], threads, "127.0.0.1", 0, CPU, None)


def test_serve_compile_decodes_as_eager_and_compiles_nothing_while_serving(runs, english, served):
    """`nmt serve --compile` end to end: its decoding process compiles the tiny transformer
    (warming up on made-up sentences with the run's search settings) before the server says
    ready: two graphs, the encoder's and the step's, whatever the batch (`unbacked_batches`:
    backed batch sizes made 6). Then one sentence a request, all at once in the run's beam
    search, and arriving in groups (joining a running batch at its next step, a batch down to
    one sentence) in beam 4 with an n-best of 2 and in greedy search: each gets what eager
    decoding gives (fp32: texts, scores within 1e-4), decoded together, and no graph is
    compiled while serving (`/stats`; a graph compiled under a server's load held requests for
    tens of seconds)."""
    engine, d = served[0].engine, served[0].engine.config.decode
    lines = sorted(english[:32], key=len)[::2]  # 16 of clearly different lengths
    groups = [1, 2, 3, 1, 1, 2, 4, 1, 1]  # arrivals 30 ms apart, a group at once
    stagger = [0.03 * g for g, n in enumerate(groups) for _ in range(n)]
    cases = [  # (request fields, what `nmt translate` searches with them, delays)
        ({}, search_options(d, nbest=1), None),
        ({"beam": 4, "nbest": 2}, search_options(d, beam=4, nbest=2), stagger),
        ({"beam": 1}, search_options(d, beam=1, nbest=1), stagger),
    ]
    args = [*FP32, "--compile", "--workers", "1", "--max-wait-ms", "5"]
    # ready once every warm-up graph is compiled: up to 13, and over 15, minutes on a slow 2-core CI
    # machine beside the other test worker (the server itself gives up on a decoding process
    # silent for 10 minutes, one graph's compiling: `nmt.decode_process.START_TIMEOUT_S`)
    with nmt_server(runs["tiny"], *args, within=1800) as (_, url):
        before = get(f"{url}/stats").json()
        assert before["graphs_compiled_while_serving"] == 0  # the warm-up's are not counted
        assert before["graphs_compiled_warming_up"] == 2
        for fields, opts, delays in cases:
            want = translate_lines(
                engine.model, engine.tokenizer, lines, opts, d.batch_tokens, CPU, "fp32"
            )
            bodies = [{"text": line, "scores": True, **fields} for line in lines]
            for nbest, answer in zip(want, post_all(url, bodies, delays)):
                assert answer.status_code == 200, answer.text
                (got,) = answer.json()["translations"]
                hyps = got.get("nbest") or [got]  # a 1-best answer has no "nbest"
                assert [h["text"] for h in hyps] == [text for text, _ in nbest]
                scores = [h["score"] for h in hyps]
                assert scores == pytest.approx([h.score for _, h in nbest], abs=1e-4)
        after = get(f"{url}/stats").json()
        assert after["sentences"] - before["sentences"] == 3 * len(lines)
        assert after["batches"] - before["batches"] < 3 * len(lines)
        assert after["graphs_compiled_while_serving"] == 0


def test_a_warm_up_reports_each_step(served, monkeypatch):
    """`NMTEngine.warm_up` says when each step is done (a decoding process tells the server,
    which waits as long as it hears from it: compiling takes longer on a slower machine, and
    the longest silence is one graph's compiling)."""
    engine = served[0].engine
    steps, reports = [], []
    step = NMTStream.step

    def counted(self):
        steps.append(len(reports))
        return step(self)

    monkeypatch.setattr(NMTStream, "step", counted)
    engine.warm_up(search_options(engine.config.decode), lambda: reports.append(len(steps)))
    assert len(steps) > len(WARM_UP)  # batches, one alone, then sentences joining
    assert reports == list(range(1, len(steps) + 1))  # a report after each step, before the next


def test_a_decoding_process_counts_the_graphs_compiled_while_serving(caplog):
    """Every answer of a decoding process says how many graphs it has compiled since it
    started: those before "ready" are its warm-up's; each one after is counted for /stats and
    logged once (what a decoding process that compiles sends, as numbers)."""
    process = DecodeProcess([], threads=1)
    with caplog.at_level(logging.WARNING, logger="nmt.decode_process"):
        process.count_graphs("error", 2)  # failed while it loaded: not serving
        assert process.graphs_warming_up == 0  # not ready yet
        process.count_graphs("ready", 7)
        process.count_graphs("ok", 7)
        assert process.graphs_while_serving == 0 and not caplog.records
        process.count_graphs("ok", 8)
        process.count_graphs("ok", 8)
        process.count_graphs("error", 10)  # a failed step that compiled too
    assert process.graphs_while_serving == 3 and process.graphs_warming_up == 7
    assert [r.getMessage().split(" (")[1] for r in caplog.records] == [
        "1 since it was ready): its batch waited for it; the warm-up met no batch of that shape",
        "3 since it was ready): its batch waited for it; the warm-up met no batch of that shape",
    ]
