"""Search properties on tiny models trained on Multi30k: greedy, beam, sampling and constraints.

The models are trained through the Python API (seconds each) once per session: `tiny_run`
keeps them in the session's throwaway NMT_CACHE_DIR, where tests/test_translate_cli.py finds
them too. They do not translate well, which is fine: every property here holds for any model.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import tiny_run

from nmt.config import DecodeConfig
from nmt.data.prepare import prepare
from nmt.models.base import StepOutput, fixed_weights
from nmt.models.layers import PackedInference
from nmt.search import (
    BeamStream,
    SearchOptions,
    SearchStopped,
    batch_rows,
    beam_search,
    force_decode,
    greedy,
    max_lengths,
    next_logprobs,
    search,
    topk_candidates,
)
from nmt.special import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from nmt.translate import decode_ids, decode_workers, load_model, search_options

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("seq2seq", "rnn_attention", "transformer")
# The transformer serves the beam-versus-greedy comparison, which needs a model past the
# "same word forever" stage of training (at 80 steps beam-5 beats greedy on only 40-86% of
# sentences, depending on the slice and the thread count; at 160 steps on 93-97%).
STEPS = {"seq2seq": 40, "rnn_attention": 40, "transformer": 160}
N_SOURCES = 100
CPU = torch.device("cpu")


@dataclass
class Trained:
    arch: str
    model: torch.nn.Module
    sources: list[list[int]]  # token ids (no EOS) of the first test_2016_flickr sentences


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two
    spinning OpenMP pools make decoding 10-30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runs(multi30k_dir, _one_thread):
    cache: dict[str, Trained] = {}

    def get(arch: str) -> Trained:
        if arch not in cache:
            run_dir, cfg = tiny_run(arch, STEPS[arch])
            split = prepare(cfg).split("test_2016_flickr")
            sources = [split.src_ids(i).tolist() for i in range(N_SOURCES)]
            cache[arch] = Trained(arch, load_model(run_dir, CPU).model, sources)
        return cache[arch]

    return get


@pytest.fixture(params=ARCHS)
def trained(request, runs) -> Trained:
    return runs(request.param)


@pytest.fixture
def transformer(runs) -> Trained:
    return runs("transformer")


def make_batch(sources: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded src[B,S] with EOS after every sentence, and its mask."""
    width = max(len(s) for s in sources) + 1
    src = torch.full((len(sources), width), PAD_ID, dtype=torch.long)
    for i, s in enumerate(sources):
        src[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        src[i, len(s)] = EOS_ID
    return src, src != PAD_ID


def varied(sources: list[list[int]], n: int) -> list[list[int]]:
    """n sources of clearly different lengths (shortest, longest and in between)."""
    by_len = sorted(sources, key=len)
    picks = [by_len[round(i * (len(by_len) - 1) / (n - 1))] for i in range(n)]
    assert len({len(s) for s in picks}) > n // 2
    return picks


def decode(model, sources, **opts):
    src, mask = make_batch(sources)
    return search(model, src, mask, SearchOptions(**opts))


def tokens_of(results) -> list[list[int]]:
    return [hyps[0].tokens for hyps in results]


def model_logprob(model, source: list[int], tokens: list[int]) -> float:
    src, mask = make_batch([source])
    logps, _ = force_decode(model, src, mask, tokens)
    return math.fsum(logps)


class Wrapped(torch.nn.Module):
    """A trained model as it is: the test models below change what they say of it
    (no `join`: a wrapper that joins says so itself)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def encode(self, src, src_mask):
        return self.model.encode(src, src_mask)

    def init_state(self, memory):
        return self.model.init_state(memory)

    def step(self, prev, state):
        return self.model.step(prev, state)


class Biased(Wrapped):
    """A trained model pushed to extremes: `eos` > 0 wants to stop at once, < 0 never wants to
    stop; `repeat` > 0 wants to repeat the previous token forever; `unk` > 0 wants <unk>."""

    def __init__(
        self, model: torch.nn.Module, eos: float = 0.0, repeat: float = 0.0, unk: float = 0.0
    ) -> None:
        super().__init__(model)
        self.eos, self.repeat, self.unk = eos, repeat, unk

    def step(self, prev, state):
        out, state = self.model.step(prev, state)
        logits = out.logits.clone()
        logits[:, EOS_ID] += self.eos
        logits[:, UNK_ID] += self.unk
        logits[torch.arange(prev.size(0)), prev] += self.repeat
        return StepOutput(logits, out.attention), state


def test_beam_of_one_is_greedy(trained):
    sources = trained.sources[:40]
    src, mask = make_batch(sources)
    g = greedy(trained.model, src, mask, SearchOptions(beam=1, length_penalty=0.0))
    b = beam_search(trained.model, src, mask, SearchOptions(beam=1, length_penalty=0.0))
    assert tokens_of(b) == tokens_of(g)
    for gh, bh in zip(g, b):
        assert bh[0].logprob == pytest.approx(gh[0].logprob, abs=1e-4)


def stream_decode(model, sources, opts, arrivals):
    """Decode `sources` with a `BeamStream`: before step i the sentences `arrivals[i]`
    (a count) join those still being decoded. Results by sentence, and the most sentences
    that were decoded at once."""
    stream, results, todo, step, most = BeamStream(model, opts), {}, list(sources), 0, 0
    ids = iter(range(len(sources)))
    with fixed_weights(model):
        while todo or stream:
            n = arrivals[step] if step < len(arrivals) else len(todo)
            if n and todo:
                batch, todo = todo[:n], todo[n:]
                stream.add(*make_batch(batch), [next(ids) for _ in batch])
            most = max(most, len(stream))
            if stream:
                results.update(stream.step())
            step += 1
    return [results[i] for i in range(len(sources))], most


@pytest.mark.parametrize(
    "opts",
    [
        SearchOptions(beam=1),
        SearchOptions(beam=4, nbest=2),
        SearchOptions(beam=3, patience=1.0, length_norm="plain"),
        SearchOptions(beam=3, length_penalty=0.0, nbest=3),
        SearchOptions(beam=2, no_repeat_ngram=2, min_len=3, max_len_a=0.0, max_len_b=6),
    ],
    ids=["greedy", "beam4-nbest2", "patience", "no-penalty", "constraints"],
)
def test_sentences_joining_a_running_search_are_searched_as_alone(trained, opts):
    """`BeamStream`: sentences that join others half-way through their search (one or a few
    at a time, of every length) get the n-best lists that `search` gives them on their own,
    up to rounding of the scores."""
    sources = varied(trained.sources, 16)
    arrivals = [3, 0, 1, 2, 0, 0, 1, 1, 0, 4]  # then the rest
    got, most = stream_decode(trained.model, sources, opts, arrivals)
    assert most >= 4  # sentences did share the batch
    for source, hyps in zip(sources, got):
        src, mask = make_batch([source])
        (alone,) = search(trained.model, src, mask, opts)
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-4)
        assert [h.logprob for h in hyps] == pytest.approx([h.logprob for h in alone], abs=1e-4)


class RowCounts(Wrapped):
    """Records the hypothesis rows of every step."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.rows = []

    def step(self, prev, state):
        self.rows.append(prev.size(0))
        return self.model.step(prev, state)


def test_a_batch_shrinks_by_steps_of_its_row_ladder(transformer):
    """Sentences that end stay in the batch, unread, until the live ones fit in fewer rows
    (`batch_rows`): a beam search of 40 sentences decodes on a few row counts (oneDNN makes
    kernels per shape), not one more at every sentence that ends; results are unchanged."""
    assert [batch_rows(n) for n in (1, 5, 8, 9, 12, 13, 32, 33, 41)] == [
        1, 5, 8, 12, 12, 16, 32, 40, 48,
    ]  # fmt: skip
    sources = transformer.sources[:40]
    opts = SearchOptions(beam=4)
    counting = RowCounts(transformer.model)
    got = search(counting, *make_batch(sources), opts)
    sizes = sorted({rows // opts.beam for rows in counting.rows[1:]}, reverse=True)
    assert sizes[0] == 40 and len(sizes) < 20
    assert all(size == batch_rows(size) for size in sizes)
    for source, hyps in zip(sources, got):
        (alone,) = search(transformer.model, *make_batch([source]), opts)
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]


def test_a_long_stream_of_sentences_joining_one_at_a_time(transformer):
    """A dozen sentences in the batch and one joining as each ends, for 60 sentences (more
    steps than any sentence may take): every sentence is searched as alone, and the batch
    never holds more rows than its sentences."""
    sources, opts = transformer.sources[:60], SearchOptions(beam=3)
    stream, results, todo, rows = BeamStream(transformer.model, opts), {}, list(range(60)), []
    with fixed_weights(transformer.model):
        while todo or stream:
            take, todo = todo[: 12 - len(stream)], todo[12 - len(stream) :]
            if take:
                stream.add(*make_batch([sources[i] for i in take]), take)
            rows.append(len(stream.ids))
            results.update(stream.step())
    assert len(rows) > 2 * max(max_lengths(make_batch(sources)[1], opts).tolist())
    assert max(rows) < 16  # the first batch may keep an ended sentence; none stays after
    for i, source in enumerate(sources):
        (alone,) = search(transformer.model, *make_batch([source]), opts)
        assert [h.tokens for h in results[i]] == [h.tokens for h in alone]


class FailsToJoin(Wrapped):
    """A model whose next `join` fails (memory running out as two states are put together)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.fail = False

    def join(self, a, b):
        if self.fail:
            self.fail = False
            raise RuntimeError("out of memory")
        return self.model.join(a, b)


def test_a_stream_whose_join_fails_goes_on_with_its_sentences(transformer):
    """`add` fails when the states cannot be joined: the stream is left as it was, and its
    sentences are searched to their end as alone; an empty stream's step decodes nothing."""
    model, opts = FailsToJoin(transformer.model), SearchOptions(beam=3)
    sources = transformer.sources[:6]
    stream, results = BeamStream(model, opts), {}
    assert stream.step() == []
    with fixed_weights(transformer.model):
        stream.add(*make_batch(sources[:4]), [0, 1, 2, 3])
        results.update(stream.step())
        model.fail = True
        with pytest.raises(RuntimeError, match="out of memory"):
            stream.add(*make_batch(sources[4:]), [4, 5])
        assert len(stream) == 4 - len(results)
        while stream:
            results.update(stream.step())
    assert sorted(results) == [0, 1, 2, 3]
    for i in range(4):
        (alone,) = search(transformer.model, *make_batch([sources[i]]), opts)
        assert [h.tokens for h in results[i]] == [h.tokens for h in alone]


def test_sampling_beside_ended_sentences_with_an_ngram_ban(trained):
    """On CPU ended sentences stay in a batch (`batch_rows`) while the others are sampled;
    they draw nothing, so an n-gram ban that leaves them no token past their length limit
    breaks nothing."""
    sources = varied(trained.sources, 16)
    opts = SearchOptions(beam=1, sample=True, seed=3, no_repeat_ngram=1, max_len_a=1.0, max_len_b=1)
    results = search(trained.model, *make_batch(sources), opts)
    limits = max_lengths(make_batch(sources)[1], opts).tolist()
    for hyps, limit in zip(results, limits):
        (hyp,) = hyps
        assert len(hyp.tokens) < limit and len(set(hyp.tokens)) == len(hyp.tokens)


def test_a_stream_of_one_batch_is_beam_search(transformer):
    """All sentences added at once, then stepped to the end: `beam_search` exactly."""
    sources = transformer.sources[:24]
    opts = SearchOptions(beam=4, nbest=4)
    got, _ = stream_decode(transformer.model, sources, opts, [len(sources)])
    assert got == beam_search(transformer.model, *make_batch(sources), opts)


def test_beam_finds_higher_model_scores_than_greedy(transformer):
    """Beam 5 is a better search than greedy for the model's own objective (sum of log-probs,
    re-scored independently with force_decode in fp32) on the large majority of sentences."""
    model, sources = transformer.model, transformer.sources
    g = decode(model, sources, beam=1, length_penalty=0.0)
    b = decode(model, sources, beam=5, length_penalty=0.0)
    g_scores = [model_logprob(model, s, h[0].tokens) for s, h in zip(sources, g)]
    b_scores = [model_logprob(model, s, h[0].tokens) for s, h in zip(sources, b)]
    at_least = sum(bs >= gs - 1e-4 for bs, gs in zip(b_scores, g_scores))
    assert at_least >= 0.8 * len(sources), f"beam >= greedy on only {at_least}/{len(sources)}"
    assert sum(b_scores) / len(b_scores) > sum(g_scores) / len(g_scores)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("limits", ["natural", "tight"])
def test_hypothesis_logprob_is_the_model_logprob(trained, beam, limits):
    """Hypothesis.logprob equals force_decode's sum of token log-probs (EOS included), also for
    outputs cut at the length limit, where EOS is forced but still costs its log-prob."""
    model, sources = trained.model, trained.sources[:30]
    src, mask = make_batch(sources)
    a, b = (1.5, 10) if limits == "natural" else (0.0, 3)
    opts = SearchOptions(beam=beam, nbest=beam, max_len_a=a, max_len_b=b)
    results = search(model, src, mask, opts)
    if limits == "tight":  # the forced-EOS case is exercised
        assert any(len(h.tokens) == b - 1 for hyps in results for h in hyps)
    for source, hyps in zip(sources, results):
        for h in hyps:
            assert h.logprob == pytest.approx(model_logprob(model, source, h.tokens), abs=1e-4)


@pytest.mark.parametrize("beam", [1, 3])
def test_batch_independence(trained, beam):
    """A sentence decodes to the same tokens alone and inside a padded batch of others."""
    sources = varied(trained.sources, 8)
    batched = decode(trained.model, sources, beam=beam, nbest=beam)
    for source, in_batch in zip(sources, batched):
        alone = decode(trained.model, [source], beam=beam, nbest=beam)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in in_batch]
        for a, c in zip(alone, in_batch):
            assert a.logprob == pytest.approx(c.logprob, abs=1e-4)


def test_incremental_decoding_equals_full_recompute(trained):
    """The cached step-by-step decoder picks, at every step, the argmax of the logits that a full
    forward pass over the whole prefix gives; the log-probs add up to the hypothesis logprob."""
    model = trained.model
    opts = SearchOptions(beam=1, length_penalty=0.0)
    for source in varied(trained.sources, 6):
        src, mask = make_batch([source])
        hyp = search(model, src, mask, opts)[0][0]
        limit = int(max_lengths(mask, opts)[0])
        chosen = [*hyp.tokens, EOS_ID]
        prefix = [BOS_ID]
        total = 0.0
        with torch.no_grad():
            for t, token in enumerate(chosen):
                logits = model(src, mask, torch.tensor([prefix]))[0, -1]
                logp = torch.log_softmax(logits.float(), -1)
                total += float(logp[token])
                allowed = logp.clone()
                allowed[[PAD_ID, BOS_ID]] = -math.inf
                if t < opts.min_len:
                    allowed[EOS_ID] = -math.inf
                if t + 1 < limit:  # at the limit EOS is forced, not chosen
                    assert int(allowed.argmax()) == token, f"step {t}"
                prefix.append(token)
        assert total == pytest.approx(hyp.logprob, abs=1e-4)


def test_nbest_lists(trained):
    alpha = 1.0
    results = decode(trained.model, trained.sources[:30], beam=5, nbest=4, length_penalty=alpha)
    for hyps in results:
        assert len(hyps) == 4
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 4
        for h in hyps:  # score = logprob / GNMT length penalty (EOS counted)
            assert h.score == pytest.approx(h.logprob / ((5 + len(h.tokens) + 1) / 6) ** alpha)


@pytest.mark.parametrize("beam", [1, 5])
def test_plain_length_normalisation_divides_by_length_to_the_alpha(trained, beam):
    """length_norm plain: score = logprob / |y| ** alpha, |y| counting the EOS (CTranslate2's
    normalisation, see nmt.engine); the n-best list is ranked by it."""
    alpha = 0.8
    results = decode(
        trained.model,
        trained.sources[:30],
        beam=beam,
        nbest=beam,
        length_penalty=alpha,
        length_norm="plain",
    )
    for hyps in results:
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            assert h.score == pytest.approx(h.logprob / (len(h.tokens) + 1) ** alpha)


@pytest.mark.parametrize("beam", [1, 3])
def test_max_length(trained, beam):
    a, b = 0.6, 3
    sources = trained.sources[:40]
    bounds = [math.floor(a * (len(s) + 1) + b) - 1 for s in sources]  # src length with EOS
    results = decode(trained.model, sources, beam=beam, nbest=beam, max_len_a=a, max_len_b=b)
    for hyps, bound in zip(results, bounds):
        assert all(len(h.tokens) <= bound for h in hyps)
    # A model that never wants to stop is cut exactly at the bound.
    endless = decode(Biased(trained.model, eos=-50.0), sources, beam=beam, max_len_a=a, max_len_b=b)
    assert [len(t) for t in tokens_of(endless)] == bounds


class FirstTokens(Wrapped):
    """A trained model's next-token scores over its first `v` token ids only (the specials
    among them): a vocabulary smaller than twice the beam."""

    def __init__(self, model: torch.nn.Module, v: int) -> None:
        super().__init__(model)
        self.v = v

    def step(self, prev, state):
        out, state = self.model.step(prev, state)
        return StepOutput(out.logits[:, : self.v].contiguous(), out.attention), state


def lowest_index_topk(self, k, dim=-1, largest=True, sorted=True):
    """Tensor.topk with ties broken towards the lowest index: as valid an order as CPU's (torch
    leaves the order of ties unspecified, and CUDA's differs from CPU's)."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@pytest.mark.parametrize(
    "vocab, beam, limit, ties",
    [(5, 4, 1, "torch"), (6, 5, 1, "torch"), (None, 3, 4, "lowest"), (None, 5, 4, "lowest")],
)
def test_hypotheses_that_end_at_the_length_limit_stay_ended(
    transformer, monkeypatch, vocab, beam, limit, ties
):
    """At its length limit every hypothesis of a sentence ends (EOS is forced), and the
    sentence is done: no step past the limit, no hypothesis that went on after its EOS. Where
    fewer than `beam` candidates are not EOS (the limit; a vocabulary under twice the beam),
    the live ones are picked among dead (-inf) candidates, in an order torch leaves open: an
    EOS candidate picked there must stay dead, whichever order the ties come in."""
    if ties == "lowest":
        monkeypatch.setattr(torch.Tensor, "topk", lowest_index_topk)
    model = transformer.model if vocab is None else FirstTokens(transformer.model, vocab)
    recorder = StepRecorder(model)
    monkeypatch.setattr(model, "step", recorder)
    sources = transformer.sources[:12]
    results = decode(model, sources, beam=beam, nbest=beam, max_len_a=0.0, max_len_b=limit)
    assert len(recorder.sizes) <= limit  # the limit counts EOS: `limit` steps at most
    for source, hyps in zip(sources, results):
        assert hyps and len({tuple(h.tokens) for h in hyps}) == len(hyps)  # no repeats
        for h in hyps:
            assert len(h.tokens) <= limit - 1
            assert h.logprob == pytest.approx(model_logprob(model, source, h.tokens), abs=1e-4)


@pytest.mark.parametrize("beam", [1, 3])
def test_min_length(trained, beam):
    eager = Biased(trained.model, eos=50.0)  # wants to stop at once
    sources = trained.sources[:20]
    assert {len(t) for t in tokens_of(decode(eager, sources, beam=beam))} == {1}
    results = decode(eager, sources, beam=beam, nbest=beam, min_len=6)
    assert all(len(h.tokens) >= 6 for hyps in results for h in hyps)
    assert {len(t) for t in tokens_of(results)} == {6}


def repeated_ngrams(tokens: list[int], n: int) -> int:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams))


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("n", [2, 3])
def test_no_repeat_ngram(trained, beam, n):
    sources = trained.sources[:20]
    stutter = Biased(trained.model, repeat=50.0)
    free = decode(stutter, sources, beam=beam, nbest=beam)
    assert all(repeated_ngrams(h.tokens, n) > 0 for hyps in free for h in hyps)
    for model in (stutter, trained.model):
        results = decode(model, sources, beam=beam, nbest=beam, no_repeat_ngram=n)
        for hyps in results:
            assert len(hyps) == beam
            for h in hyps:
                assert repeated_ngrams(h.tokens, n) == 0, h.tokens


@pytest.mark.parametrize("opts", [dict(beam=1), dict(beam=3, nbest=3), dict(beam=1, sample=True)])
def test_ban_unk(trained, opts):
    fond = Biased(trained.model, unk=50.0)  # <unk> at every position
    sources = trained.sources[:20]
    free = decode(fond, sources, **opts)
    assert all(UNK_ID in h.tokens for hyps in free for h in hyps)
    banned = decode(fond, sources, ban_unk=True, **opts)
    assert all(len(hyps) == opts.get("nbest", 1) for hyps in banned)
    assert not any(UNK_ID in h.tokens for hyps in banned for h in hyps)
    assert search_options(DecodeConfig(ban_unk=True)).ban_unk


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("bias", [0.0, 50.0, -50.0])
def test_fixed_length(trained, beam, bias):
    model = Biased(trained.model, eos=bias) if bias else trained.model
    results = decode(model, trained.sources[:20], beam=beam, nbest=beam, fixed_len=9)
    assert {len(h.tokens) for hyps in results for h in hyps} == {9}


def test_sampling_is_reproducible(trained):
    sources = trained.sources[:20]
    opts = dict(beam=1, sample=True, temperature=1.5, top_p=0.95)
    first = tokens_of(decode(trained.model, sources, seed=7, **opts))
    again = tokens_of(decode(trained.model, sources, seed=7, **opts))
    other = tokens_of(decode(trained.model, sources, seed=8, **opts))
    assert first == again
    assert first != other


def test_sampling_at_a_vanishing_temperature_is_greedy(trained):
    """logp / 1e-40 was -inf for every token in fp32 (softmax NaN: torch.multinomial
    raised); the best token is put at 0 first, so the limit is greedy search."""
    sources = trained.sources[:30]
    kw = dict(beam=1, max_len_a=0.8, max_len_b=3)
    g = decode(trained.model, sources, **kw)
    s = decode(trained.model, sources, sample=True, temperature=1e-40, seed=3, **kw)
    assert tokens_of(s) == tokens_of(g)


@pytest.mark.parametrize("min_len", [1, 5])
def test_sampling_top_k_1_is_greedy(trained, min_len):
    """top-k=1 keeps only the best token the constraints allow, so it is greedy search."""
    sources = trained.sources[:30]
    kw = dict(beam=1, min_len=min_len, max_len_a=0.8, max_len_b=3)
    g = decode(trained.model, sources, **kw)
    s = decode(trained.model, sources, sample=True, top_k=1, temperature=0.7, seed=3, **kw)
    assert tokens_of(s) == tokens_of(g)
    for gh, sh in zip(g, s):
        assert sh[0].logprob == pytest.approx(gh[0].logprob, abs=1e-5)
    # Even a model that would stop at once: top-k is applied among allowed tokens only.
    eager = Biased(trained.model, eos=50.0)
    g = decode(eager, sources, **kw)
    s = decode(eager, sources, sample=True, top_k=1, seed=3, **kw)
    assert tokens_of(s) == tokens_of(g)


class StepRecorder:
    """Wraps model.step to record the number of rows decoded at each call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner, self.sizes = model.step, []

    def __call__(self, prev, state):
        self.sizes.append(int(prev.size(0)))
        return self.inner(prev, state)


def ladder(ends: list[int]) -> list[int]:
    """Sentences decoded at each step when sentence i ends at its step ends[i] - 1: all of
    them at first, then, as they end, the live ones and as many ended ones as it takes to
    make `batch_rows` of them, when that is fewer than before."""
    rows, sizes = len(ends), []
    for t in range(max(ends)):
        sizes.append(rows)
        live = sum(e > t + 1 for e in ends)
        rows = min(rows, batch_rows(live))
    return sizes


def test_finished_sentences_leave_the_batch_greedy(trained, monkeypatch):
    sources = varied(trained.sources, 10)
    recorder = StepRecorder(trained.model)
    monkeypatch.setattr(trained.model, "step", recorder)
    # Never wanting to stop, every sentence runs to its own length limit.
    results = decode(Biased(trained.model, eos=-50.0), sources, beam=1)
    ends = [len(t) + 1 for t in tokens_of(results)]  # steps each sentence took (EOS included)
    assert len(set(ends)) > 1
    # At step t the sentences that have not emitted EOS yet are decoded, and ended ones only
    # until the live ones fit in fewer rows.
    assert recorder.sizes == ladder(ends)
    assert recorder.sizes[0] == len(sources) and recorder.sizes[-1] < len(sources)


@pytest.mark.parametrize("eos", [0.0, -50.0])
def test_finished_sentences_leave_the_batch_beam(trained, monkeypatch, eos):
    k = 3
    sources = varied(trained.sources, 10)
    recorder = StepRecorder(trained.model)
    monkeypatch.setattr(trained.model, "step", recorder)
    opts = SearchOptions(beam=k)
    src, mask = make_batch(sources)
    search(Biased(trained.model, eos=eos), src, mask, opts)
    sizes = recorder.sizes
    # The K beams of a sentence are identical before the first token: one row per sentence.
    assert sizes[0] == len(sources)
    assert all(s % k == 0 for s in sizes[1:])
    assert all(a >= b for a, b in zip(sizes[1:], sizes[2:]))
    assert len(sizes) <= int(max_lengths(mask, opts).max())
    if eos < 0:  # every sentence lives until its own limit, then leaves (`ladder`)
        limits = max_lengths(mask, opts).tolist()
        width = [1] + [k] * (max(limits) - 1)
        assert sizes == [w * rows for w, rows in zip(width, ladder(limits))]
    else:
        assert sizes[-1] < sizes[0]


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_patience_ends_sentences_sooner_than_the_exact_rule(transformer, monkeypatch, alpha):
    """One sentence at a time (its step count is the batch's): with patience P a sentence ends
    once round(K*P) hypotheses finished (alpha 0: once its best candidate ended, whatever P),
    the same steps as the exact rule up to then, so patience 1 never decodes longer than the
    exact rule or patience 2 and never finds a better hypothesis; and it does stop sooner."""
    model = transformer.model
    recorder = StepRecorder(model)
    monkeypatch.setattr(model, "step", recorder)
    steps: dict[float | None, list[int]] = {1.0: [], 2.0: [], None: []}
    best: dict[float | None, list[float]] = {1.0: [], 2.0: [], None: []}
    for source in varied(transformer.sources, 12):
        for patience in steps:
            recorder.sizes = []
            opts = dict(beam=4, length_penalty=alpha, length_norm="plain", patience=patience)
            (hyps,) = decode(model, [source], **opts)
            steps[patience].append(len(recorder.sizes))
            best[patience].append(hyps[0].score)
    for longer in (2.0, None):
        assert all(a <= b for a, b in zip(steps[1.0], steps[longer]))
        assert all(a <= b + 1e-5 for a, b in zip(best[1.0], best[longer]))
    assert sum(steps[1.0]) < sum(steps[None])
    if alpha == 0:
        assert steps[1.0] == steps[2.0]
    else:
        assert sum(steps[1.0]) < sum(steps[2.0])


def test_next_logprobs_are_log_softmax_in_fp32():
    """fp32 CPU logits are overwritten by their log-probs (the search owns a step's output);
    reduced-precision logits give new fp32 log-probs; logits that need a gradient stay."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits, -1)
    with torch.inference_mode():
        fp32 = logits.clone()
        out = next_logprobs(fp32)
        assert out.data_ptr() == fp32.data_ptr() and torch.equal(out, expected)
        half = logits.bfloat16()
        out = next_logprobs(half)
        assert out.dtype == torch.float32 and torch.equal(
            out, torch.log_softmax(half, -1, dtype=torch.float32)
        )
    leaf = logits.clone().requires_grad_()
    out = next_logprobs(leaf)
    assert torch.equal(leaf, logits) and torch.equal(out.detach(), expected)


@pytest.mark.parametrize(
    "n, w, cols, k",
    [(64, 5, 8000, 10), (320, 1, 8000, 1), (7, 2, 8000 + 37, 10), (3, 4, 700, 2), (5, 1, 4000, 3)],
)
def test_topk_candidates_equals_torch_topk(n, w, cols, k):
    gen = torch.Generator().manual_seed(n + w + cols + k)
    x = torch.randn(n * w, cols, generator=gen)
    scores = torch.randn(n, w, generator=gen) * 3
    x[:w] = float("-inf")  # a sentence with nothing allowed
    x[w, -3:] = torch.tensor([50.0, 52.0, 51.0])  # the best entries in the partial last block
    x[-1, 100:200] = float("-inf")
    if w > 1:
        scores[-1, 0] = float("-inf")  # a dead hypothesis
    for sc in (scores, None):
        values, index = topk_candidates(x, k, sc)
        # without scores every row is a sentence of its own (greedy search)
        cand = x if sc is None else (x + sc.reshape(-1, 1)).view(n, w * cols)
        expected = cand.topk(k, 1)
        assert torch.equal(values, expected.values)
        assert torch.equal(cand.gather(1, index), values)  # the indices hold those values
        real = torch.isfinite(values).all(1)  # no ties in continuous noise
        assert torch.equal(index[real], expected.indices[real])
        if k == 1:
            assert torch.equal(index[real, 0], cand[real].argmax(1))


@pytest.mark.parametrize("beam", [1, 4])
def test_parallel_workers_decode_as_one(trained, beam):
    """Two workers (two batches at once, in threads) give exactly what one gives, in input
    order, report every sentence once to the progress callback, and leave torch's thread
    count and the model's packed weights as they were."""
    model, sources = trained.model, trained.sources[:60]
    opts = SearchOptions(beam=beam, nbest=beam)
    one = decode_ids(model, sources, opts, 40 * beam, CPU, "fp32", workers=1)
    done: list[int] = []
    two = decode_ids(model, sources, opts, 40 * beam, CPU, "fp32", done.append, workers=2)
    assert len(done) >= 8 and sum(done) == len(sources)  # many batches
    assert [[h.tokens for h in n] for n in two] == [[h.tokens for h in n] for n in one]
    assert [[h.logprob for h in n] for n in two] == [[h.logprob for h in n] for n in one]
    assert torch.get_num_threads() == 1
    assert all(m.weight_cache is None for m in model.modules() if isinstance(m, PackedInference))


def test_parallel_workers_start_the_longest_batches_first(transformer):
    """Workers take the batches with the longest sources first (the progress callback
    hears of them in that order: their sizes tell them apart); the results come back in
    batch order, as one worker gives them."""
    from nmt.translate import decode_batches, source_batch

    model, sources = transformer.model, sorted(transformer.sources[:40], key=len)
    batches = [source_batch(sources[:3]), source_batch(sources[-2:]), source_batch(sources[10:14])]
    widths = [b.size(1) for b in batches]
    assert widths[1] > widths[2] > widths[0]
    opts = SearchOptions(beam=2)
    one = decode_batches(model, batches, opts, CPU, "fp32", workers=1)
    sizes: list[int] = []
    two = decode_batches(model, batches, opts, CPU, "fp32", workers=2, progress=sizes.append)
    assert sizes == [2, 4, 3]  # widest sources first, then narrower
    assert [[h.tokens for h in n] for b in two for n in b] == [
        [h.tokens for h in n] for b in one for n in b
    ]


def test_parallel_workers_split_the_threads(transformer):
    """With 2 threads, 2 workers of 1 thread each decode the tokens 1 worker of 2 threads does;
    afterwards torch has its 2 threads again."""
    model, sources = transformer.model, transformer.sources[:40]
    opts = SearchOptions(beam=3)
    torch.set_num_threads(2)
    try:
        assert decode_workers(0, CPU, 10) == 2
        one = decode_ids(model, sources, opts, 150, CPU, "fp32", workers=1)
        two = decode_ids(model, sources, opts, 150, CPU, "fp32", workers=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert tokens_of(two) == tokens_of(one)
    for a, b in zip(one, two):
        assert a[0].logprob == pytest.approx(b[0].logprob, abs=1e-4)


def test_decode_workers():
    assert decode_workers(0, CPU, 10) == 1  # auto with 1 intra-op thread (this module's)
    assert decode_workers(3, CPU, 10) == 3  # asked for: kept, even beyond the threads
    assert decode_workers(4, CPU, 2) == 2  # never more than there are batches
    assert (
        decode_workers(0, torch.device("cuda"), 10)
        == decode_workers(2, torch.device("mps"), 9)
        == 1
    )


class FailsOnLongSources(Wrapped):
    def __init__(self, model: torch.nn.Module, longest: int) -> None:
        super().__init__(model)
        self.longest = longest

    def encode(self, src, src_mask):
        if src.size(1) > self.longest:
            raise RuntimeError("a batch failed")
        return self.model.encode(src, src_mask)


def test_a_failing_batch_ends_parallel_decoding_with_its_error(transformer):
    model = FailsOnLongSources(transformer.model, 12)
    with pytest.raises(RuntimeError, match="a batch failed"):
        decode_ids(
            model, transformer.sources[:60], SearchOptions(beam=2), 60, CPU, "fp32", workers=2
        )
    assert torch.get_num_threads() == 1
    assert all(m.weight_cache is None for m in model.modules() if isinstance(m, PackedInference))


class StepsUntil(torch.nn.Module):
    """Counts the decoder steps of each batch (by source width). With `stop_at`, sets the stop
    event at that step of a batch; the batch `fail_width` wide fails at its first step, once
    another batch has taken one."""

    def __init__(self, model, stop=None, stop_at=None, fail_width=None, pause=0.0) -> None:
        super().__init__()
        self.model, self.stop, self.stop_at = model, stop, stop_at
        self.fail_width, self.pause = fail_width, pause
        self.steps: dict[int, int] = {}
        self.other_started = threading.Event()

    def encode(self, src, src_mask):
        memory = self.model.encode(src, src_mask)
        memory["src_width"] = torch.full((src.size(0),), src.size(1))  # per sentence: src_*
        return memory

    def init_state(self, memory):
        return {**self.model.init_state(memory), "src_width": memory["src_width"]}

    def step(self, prev, state):
        width = int(state["src_width"][0])
        self.steps[width] = self.steps.get(width, 0) + 1
        if width == self.fail_width:
            self.other_started.wait(30)
            raise RuntimeError("a batch failed")
        self.other_started.set()
        if self.steps[width] == self.stop_at:
            self.stop.set()
        time.sleep(self.pause)
        out, new = self.model.step(prev, state)
        return out, {**new, "src_width": state["src_width"]}


@pytest.mark.parametrize("beam", [1, 3])
def test_a_set_stop_event_ends_the_search_at_its_next_step(trained, beam):
    src, mask = make_batch(trained.sources[:4])
    stop = threading.Event()
    model = StepsUntil(trained.model, stop, stop_at=3)
    with pytest.raises(SearchStopped):
        search(model, src, mask, SearchOptions(beam=beam, fixed_len=10), stop)
    assert model.steps == {src.size(1): 3}
    stop.clear()  # unset, or not given: the search runs to its end
    assert search(trained.model, src, mask, SearchOptions(beam=beam), stop) == search(
        trained.model, src, mask, SearchOptions(beam=beam)
    )


@pytest.mark.parametrize("failing", ["first", "second"])
def test_an_error_stops_the_batch_in_flight(transformer, failing):
    """With 2 workers, a batch that fails ends the decode with its error, and the batch
    decoded beside it stops at its next step instead of running to its end (Ctrl-C takes
    the same way): it would take 201 steps here. Also when the failing batch comes second,
    while the first one is still being waited for: its error is raised, not the stop."""
    by_len = sorted(transformer.sources, key=len)
    short, long = by_len[0], by_len[-1]  # two batches of one sentence: the short one first
    fails, other = (short, long) if failing == "first" else (long, short)
    model = StepsUntil(transformer.model, fail_width=len(fails) + 1, pause=0.02)
    with pytest.raises(RuntimeError, match="a batch failed"):
        decode_ids(
            model, [long, short], SearchOptions(beam=2, fixed_len=200), 1, CPU, "fp32", workers=2
        )
    assert 1 <= model.steps[len(other) + 1] < 201
