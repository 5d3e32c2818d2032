"""Greedy, beam and sampling search over the model contract (`nmt.models.base`).

Everything is batched as tensor operations over sentences and beams. Finished sentences leave
the active batch (their state rows are dropped with `reorder_state`), so work shrinks as
sentences finish; on CPU by a ladder of row counts (`batch_rows`), so that oneDNN sees few
shapes. The source side of the state stays one row per sentence; the K hypotheses of
a sentence are adjacent rows. The search knows nothing about architectures.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from torch import Tensor

from nmt.models.base import (
    State,
    StepOutput,
    TranslationModel,
    fixed_weights,
    reorder_state,
    round_up,
    step_log_probs,
)
from nmt.special import BOS_ID, EOS_ID, PAD_ID, UNK_ID

NEG = float("-inf")
Fn = TypeVar("Fn", bound=Callable)


def decoding(fn: Fn) -> Fn:
    """Run a search function in inference mode (no autograd, and no version counters or view
    tracking: 4% faster than no_grad for beam 5 in bf16) and in a `fixed_weights` scope (the
    weights do not change while it decodes: layers may keep packed or cast copies of them)."""

    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        with torch.inference_mode(), fixed_weights(model):
            return fn(model, *args, **kwargs)

    return run  # type: ignore[return-value]


@dataclass(frozen=True)
class SearchOptions:
    beam: int = 5
    nbest: int = 1
    length_penalty: float = 1.0  # alpha
    length_norm: Literal["gnmt", "plain"] = "gnmt"  # ((5+|y|)/6)^alpha or |y|^alpha
    max_len_a: float = 1.5
    max_len_b: int = 10
    min_len: int = 1
    no_repeat_ngram: int = 0
    ban_unk: bool = False  # <unk> never chosen
    sample: bool = False  # ancestral sampling instead of greedy (beam must be 1)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    fixed_len: int | None = None  # benchmark mode: exactly this many tokens, EOS forbidden
    # When beam search ends a sentence (`ends_after`): None, once no live hypothesis can beat
    # its K best finished ones (exact); P, once round(K * P) hypotheses have finished
    # (CTranslate2's and fairseq's rule; with length_penalty 0 once its best candidate ends).
    patience: float | None = None


class SearchStopped(Exception):
    """A search ended early because its `stop` event was set (an interrupted decode, see
    `nmt.evaluate.map_in_workers`)."""


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise SearchStopped("search stopped")


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS/EOS
    score: float  # length-normalised log-probability (what the beam ranks by)
    logprob: float  # raw sum of token log-probabilities, EOS included


def length_penalty(length: Tensor | float, opts: SearchOptions) -> Tensor | float:
    if opts.length_penalty == 0:
        return 1.0 if not isinstance(length, Tensor) else torch.ones_like(length, dtype=torch.float)
    if opts.length_norm == "plain":
        return length**opts.length_penalty
    return ((5.0 + length) / 6.0) ** opts.length_penalty


def ends_after(opts: SearchOptions) -> int | None:
    """How many finished hypotheses end a sentence under `opts.patience` (rounded half away
    from zero, as CTranslate2 rounds); None for the exact stopping rule."""
    if opts.patience is None:
        return None
    return math.floor(opts.beam * opts.patience + 0.5)


def max_lengths(src_mask: Tensor, opts: SearchOptions) -> Tensor:
    """[B] output length limit a * |x| + b (tokens, EOS included; |x| counts the source EOS)."""
    if opts.fixed_len is not None:
        return torch.full((src_mask.size(0),), opts.fixed_len + 1, device=src_mask.device)
    return length_limits(src_mask.sum(1), opts)


def length_limits(src_len: Tensor, opts: SearchOptions) -> Tensor:
    """[B] output length limits a * |x| + b of sources of |x| positions (EOS included) [B]:
    the limit `max_lengths` gives, for a decoder of another engine to honour exactly."""
    return (opts.max_len_a * src_len.float() + opts.max_len_b).floor().long().clamp(min=1)


def next_logprobs(logits: Tensor) -> Tensor:
    """log_softmax of a step's logits [N,V] in fp32 (`step_log_probs` of logits alone)."""
    return step_log_probs(StepOutput(logits, None))


def _adjust(
    logp: Tensor, tokens: Tensor, t: int | Tensor, limit: Tensor, opts: SearchOptions
) -> Tensor:
    """Constraints on next-token log-probs [N,V] at step t (of every row, or per row [N]):
    specials, min/max length, n-grams. `tokens` [N,t'] holds each row's history, left-padded
    with PAD where rows are at different steps."""
    force = t + 1 >= limit  # [N] the last allowed position must be EOS
    forced = bool(force.any())
    eos = logp[:, EOS_ID].clone() if forced else None  # the model's own, kept when forced
    logp[:, PAD_ID] = NEG
    logp[:, BOS_ID] = NEG
    if opts.ban_unk:
        logp[:, UNK_ID] = NEG
    shortest = max(opts.min_len, opts.fixed_len or 0)  # EOS is not allowed before this step
    if isinstance(t, Tensor):
        logp[:, EOS_ID].masked_fill_(t < shortest, NEG)
    elif t < shortest:
        logp[:, EOS_ID] = NEG
    if forced:
        eos_only = torch.full_like(logp, NEG)
        eos_only[:, EOS_ID] = eos
        logp = torch.where(force[:, None], eos_only, logp)
    n = opts.no_repeat_ngram
    if n > 0 and tokens.size(1) >= n:
        grams = tokens.unfold(1, n, 1)  # [N, G, n] every n-gram so far
        prefix = tokens[:, tokens.size(1) - n + 1 :]  # [N, n-1] the current (n-1)-gram
        match = (grams[:, :, :-1] == prefix[:, None, :]).all(-1)  # [N, G]
        banned = torch.where(match, grams[:, :, -1], torch.full_like(grams[:, :, -1], PAD_ID))
        logp = logp.scatter(1, banned, NEG)  # PAD is banned anyway
    return logp


def topk_candidates(
    logp: Tensor, k: int, scores: Tensor | None = None, block: int = 64
) -> tuple[Tensor, Tensor]:
    """The k best expansions of every sentence: logp[n*w, V] holds the next-token log-probs of
    its w hypotheses (rows of one sentence adjacent), scores[n, w] their scores so far (zero
    when None). Returns the values scores + logp [n, k] and their indices into the w*V
    expansions of the sentence, exactly as `(scores.view(-1, 1) + logp).view(n, -1).topk(k)`.

    On CPU, topk over vocabulary-wide rows costs ~0.7 ns per element (1.6 ms for the
    [64, 5x8000] expansions of a beam-5 step), as much as a decoder layer, and adding the
    scores to all of them is another pass. Exact shortcut: the k best expansions lie in the k
    blocks (of `block` columns of one hypothesis) with the largest maxima, and a block's best
    expansion is its hypothesis' score plus the block maximum (float addition is monotonic);
    so only block maxima, [n, w*V/block], are reduced over the whole vocabulary, and topk runs
    on the k*block candidates of the chosen blocks. Entries that tie may come back in another
    order than torch.topk's.
    """
    rows, v = logp.shape
    n = rows if scores is None else scores.size(0)
    w = rows // n
    offset = None if scores is None else scores.reshape(rows, 1)
    if logp.device.type != "cpu" or v < 4 * k * block:
        cand = logp if offset is None else logp + offset
        return cand.view(n, w * v).topk(min(k, w * v), 1)
    n_blocks = -(-v // block)  # the last block may be partial
    full = (v // block) * block
    maxima = logp[:, :full].reshape(rows, v // block, block).amax(-1)  # [n*w, V/block]
    if full < v:
        maxima = torch.cat([maxima, logp[:, full:].amax(-1, keepdim=True)], 1)
    if offset is not None:
        maxima = maxima + offset
    best = maxima.view(n, w * n_blocks).topk(k, 1).indices  # [n,k] the k best blocks
    hyp, blk = best // n_blocks, best % n_blocks
    row = torch.arange(0, n * w, w, device=logp.device)[:, None] + hyp  # [n,k] rows of logp
    cols = blk[:, :, None] * block + torch.arange(block, device=logp.device)  # [n,k,block]
    if full < v:  # the partial last block: columns beyond V repeat the last one, masked
        outside = cols >= v
        cols = cols.clamp(max=v - 1)
    values = logp.take(row[:, :, None] * v + cols)  # [n,k,block], row-major flat indices
    if offset is not None:
        values = values + offset[row]
    if full < v:
        values = values.masked_fill(outside, NEG)
    top, pick = values.view(n, k * block).topk(k, 1)
    index = (hyp[:, :, None] * v + cols).view(n, k * block).gather(1, pick)
    return top, index


def _start(model: TranslationModel, src: Tensor, src_mask: Tensor) -> State:
    return model.init_state(model.encode(src, src_mask))


@decoding
def greedy(
    model: TranslationModel,
    src: Tensor,
    src_mask: Tensor,
    opts: SearchOptions,
    stop: threading.Event | None = None,
) -> list[list[Hypothesis]]:
    """Greedy (or sampled, with opts.sample) decoding of src[B,S]; raises SearchStopped at the
    next step once `stop` is set. Sentences that end stay in the batch, unread, until the
    live ones fit in fewer rows (`batch_rows`)."""
    b = src.size(0)
    device = src.device
    state = _start(model, src, src_mask)
    limit = max_lengths(src_mask, opts)  # [B]
    alive = torch.arange(b, device=device)  # original ids of the rows
    live = torch.ones(b, dtype=torch.bool, device=device)  # rows still being decoded
    n_live = b
    tokens = torch.zeros(b, 0, dtype=torch.long, device=device)
    scores = torch.zeros(b, device=device)
    prev = torch.full((b,), BOS_ID, dtype=torch.long, device=device)
    results: list[list[Hypothesis]] = [[] for _ in range(b)]
    gen = torch.Generator(device=device).manual_seed(opts.seed) if opts.sample else None
    for t in range(int(limit.max())):
        _check(stop)
        out, state = model.step(prev, state)
        logp = step_log_probs(out)  # [b,V]
        logp = _adjust(logp, tokens, t, limit[alive], opts)
        if opts.sample:  # temperature and top-k/top-p among the tokens the constraints allow
            if opts.temperature >= 1:
                scaled = logp / opts.temperature
            else:  # the best token at 0, the others scaled at most to -3.4e38 (T = 1e-40)
                scale = min(1 / opts.temperature, torch.finfo(logp.dtype).max)
                scaled = (logp - logp.amax(-1, keepdim=True)) * scale
            allowed = _filter(scaled, opts)
            if n_live < alive.numel():  # ended rows kept in the batch draw nothing
                nxt = torch.full_like(prev, EOS_ID)
                picked = torch.multinomial(allowed[live].softmax(-1), 1, generator=gen)
                nxt[live] = picked.squeeze(1)
            else:
                nxt = torch.multinomial(allowed.softmax(-1), 1, generator=gen).squeeze(1)
        else:
            nxt = topk_candidates(logp, 1)[1].squeeze(1)  # [b] argmax
        scores = scores + logp.gather(1, nxt[:, None]).squeeze(1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        done = (nxt == EOS_ID) & live
        if done.any():
            ended = done.nonzero().flatten().tolist()
            for row in ended:  # bookkeeping of finished outputs only
                toks = tokens[row, :-1].tolist()
                raw = float(scores[row])
                norm = raw / float(length_penalty(len(toks) + 1, opts))
                results[int(alive[row])] = [Hypothesis(toks, norm, raw)]
            n_live -= len(ended)
            if not n_live:
                break
            live = live & ~done
            rows = batch_rows(n_live) if device.type == "cpu" else n_live
            if rows < alive.numel():  # drop dead rows, keep `rows` in all
                keep = kept_rows(live, n_live, rows)
                alive, tokens, scores, nxt = alive[keep], tokens[keep], scores[keep], nxt[keep]
                live = live[keep]
                state = reorder_state(state, keep, sentences=keep)
        prev = nxt
    return results


def _filter(logits: Tensor, opts: SearchOptions) -> Tensor:
    """Top-k and nucleus (top-p) filtering of logits [N,V]."""
    if opts.top_k > 0:
        kth = logits.topk(min(opts.top_k, logits.size(-1)), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG)
    if opts.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > opts.top_p  # keep the smallest set reaching p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, NEG))
    return logits


def batch_rows(live: int) -> int:
    """How many sentences a batch on CPU with `live` sentences still being decoded keeps in
    its rows: `live` up to 8, then a multiple of 4 up to 32, then of 8. Sentences that have
    ended stay in the batch (computed, unread) until the live ones fit in fewer rows: oneDNN
    makes and keeps kernels for every shape it sees (~0.7 MB each, 2.4 MB for an output
    projection), and a batch that shrank by one sentence at every step made a shape per step
    (`BeamStream`). Other devices drop ended sentences at once."""
    if live <= 8:
        return live
    step = 4 if live <= 32 else 8
    return round_up(live, step)


def kept_rows(live: Tensor, n_live: int, rows: int) -> Tensor:
    """The rows a batch keeps when it shrinks to `rows`: every live one (`live` [b] bool,
    `n_live` of them) and as many of the first dead ones as it takes, in order."""
    flags = live.tolist()
    dead = [i for i, x in enumerate(flags) if not x][: rows - n_live]
    rows = sorted([i for i, x in enumerate(flags) if x] + dead)
    return torch.tensor(rows, device=live.device)


class BeamStream:
    """Beam search over sentences that come and go (in-flight batching): `add` sources
    between steps, `step` decodes one position of every active sentence and returns the
    sentences that ended. A server adds each request's sentences as they arrive, beside
    those half-way through their translation; `beam_search` adds a whole batch and steps
    until it is done. Every sentence is searched as it would be alone.

    Each step ranks the top 2K expansions of the K live hypotheses of every sentence: those
    ending in EOS (among the top K) enter the sentence's pool of K finished hypotheses, the
    best K others stay live. A sentence is done when its worst pooled hypothesis beats the
    best score any live hypothesis could still reach, or with `opts.patience` once
    round(K * patience) hypotheses have finished (without a length penalty: once its best
    candidate has ended, and n-best ones); done sentences leave the batch. Beam 1 ends a
    sentence when its best token is EOS: greedy search.

    The sentences of a fresh stream start with one hypothesis each (their first step expands
    it); sentences added beside others start with K, all but the first dead (score -inf), so
    that every sentence has K rows (`nmt.models.base`); the model's `join` puts the two
    states together. Sentences may be at different steps: the time step, the length limit
    and the token history (left-padded with PAD) are per sentence. On CPU a sentence that ends
    stays in the batch, dead (score -inf, unread), until the batch can shrink to `batch_rows`
    of the live ones; once sentences have joined the batch, it drops its dead ones when the
    next sentence ends, and those ending after leave at once.

    Call its methods in one thread at a time, under the model's `fixed_weights` (the
    `decoding` scope); each runs in inference mode.
    """

    def __init__(self, model: TranslationModel, opts: SearchOptions) -> None:
        self.model, self.opts, self.k = model, opts, opts.beam
        # beam 1: a sentence ends when its 1-best ends (greedy); else `ends_after`'s rule
        self.quota = 1 if opts.beam == 1 else ends_after(opts)
        self.ids: list = []  # the caller's id of each active sentence [b]
        self._lp: Tensor | None = None  # length_penalty(t) for t = 0, 1, ...: `_penalties`
        self._reset()

    def _reset(self) -> None:
        self.ids = []  # None for a dead sentence
        self.live = 0  # sentences being decoded
        self.joined = False  # sentences joined the batch after it started
        self.width = 1  # hypotheses per sentence: 1 before a fresh batch's first step, K after
        self.state: State | None = None

    def __len__(self) -> int:
        return self.live

    def add(self, src: Tensor, src_mask: Tensor, ids: list) -> None:
        """Start decoding sources src[B,S] (EOS-terminated, PAD-padded), known to the caller
        by `ids`; they take their first step at the next `step`."""
        with torch.inference_mode():
            self._add(src, src_mask, list(ids))

    def _add(self, src: Tensor, src_mask: Tensor, ids: list) -> None:
        b, k, device = src.size(0), self.k, src.device
        state = _start(self.model, src, src_mask)  # one row per sentence
        limit = max_lengths(src_mask, self.opts)  # [B]
        longest = int(limit.max())
        width = self.width if self.ids else 1
        scores = torch.zeros(b, width, device=device)
        if width > 1:  # beside sentences with K hypotheses: K rows, one alive
            scores[:, 1:] = NEG
            state = reorder_state(state, torch.arange(b, device=device).repeat_interleave(width))
        new = {
            "scores": scores,  # [b,width] cumulative log-probs
            "tokens": torch.full((b * width, 0), PAD_ID, dtype=torch.long, device=device),
            "prev": torch.full((b * width,), BOS_ID, dtype=torch.long, device=device),
            "steps": torch.zeros(b, dtype=torch.long, device=device),  # positions decoded
            "limit": limit,  # [b] length limits (EOS included)
            "limit_penalty": length_penalty(limit.float(), self.opts),  # [b] of the limits
            "pool_norm": torch.full((b, k), NEG, device=device),  # finished, normalised
            "pool_raw": torch.full((b, k), NEG, device=device),
            "pool_tok": torch.full((b, k, longest), PAD_ID, dtype=torch.long, device=device),
            "finished": torch.zeros(b, dtype=torch.long, device=device),  # patience counts
            "best_ended": torch.zeros(b, dtype=torch.bool, device=device),
            "live": torch.ones(b, dtype=torch.bool, device=device),
        }
        if not self.ids:
            self.ids, self.width, self.state = ids, width, state
            self.book, self.live = new, b
            return
        old = self.book
        t_old, t_new = old["tokens"].size(1), 0
        pool = max(old["pool_tok"].size(2), longest)
        joined = {}
        for key, x in old.items():
            y = new[key]
            if key == "tokens":  # left-padded histories
                y = torch.nn.functional.pad(y, (t_old - t_new, 0), value=PAD_ID)
            elif key == "pool_tok":
                x = torch.nn.functional.pad(x, (0, pool - x.size(2)), value=PAD_ID)
                y = torch.nn.functional.pad(y, (0, pool - y.size(2)), value=PAD_ID)
            joined[key] = torch.cat([x, y])
        self.state = self.model.join(self.state, state)  # first: it may fail, nothing changed
        self.book, self.joined, self.ids, self.live = joined, True, self.ids + ids, self.live + b

    def _penalties(self, lengths: Tensor) -> Tensor:
        """length_penalty of `lengths` [n], each the float32 rounding of the Python value
        (exactly what dividing by `length_penalty(float(length), opts)` divides by)."""
        need = int(lengths.max()) + 1
        if self._lp is None or self._lp.numel() < need or self._lp.device != lengths.device:
            values = [float(length_penalty(float(t), self.opts)) for t in range(2 * need)]
            self._lp = torch.tensor(values, device=lengths.device)
        return self._lp[lengths]

    def step(self) -> list[tuple[object, list[Hypothesis]]]:
        """Decode one position of every active sentence; (id, n-best) of those that ended."""
        if not self.live:
            return []
        with torch.inference_mode():
            return self._step()

    def _step(self) -> list[tuple[object, list[Hypothesis]]]:
        opts, k, book = self.opts, self.k, self.book
        out, state = self.model.step(book["prev"], self.state)
        n, width = len(self.ids), self.width
        device = book["scores"].device
        steps, limit, scores = book["steps"], book["limit"], book["scores"]
        lim = limit if width == 1 else limit[:, None].expand(n, width).reshape(-1)  # [n*width]
        t = steps if width == 1 else steps[:, None].expand(n, width).reshape(-1)
        logp = _adjust(step_log_probs(out), book["tokens"], t, lim, opts)
        v = logp.size(-1)
        # One hypothesis per sentence: candidates ranked by their token's log-prob alone, as
        # greedy search ranks them (adding the score to each could round two into a tie).
        rank, idx = topk_candidates(logp, min(2 * k, width * v), scores if width > 1 else None)
        if rank.size(1) < k:  # a vocabulary smaller than the beam: fill with dead candidates
            rank = torch.nn.functional.pad(rank, (0, k - rank.size(1)), value=NEG)
            idx = torch.nn.functional.pad(idx, (0, k - idx.size(1)), value=0)
        top = rank if width > 1 else rank + scores  # [n,2K] scores of the candidates
        beam, tok = idx // v, idx % v
        rows = torch.arange(0, n * width, width, device=device)[:, None] + beam  # [n,2K] rows

        # Finished: EOS expansions among the top K enter the pool of K best finished (most
        # steps have none: the pool is left as it is then).
        is_eos = tok == EOS_ID
        fin = is_eos[:, :k] & (top[:, :k] > NEG)  # [n,K] live ones (a log-prob is never +inf)
        if fin.any():
            hist = torch.cat([book["tokens"][rows[:, :k].flatten()], tok[:, :k].reshape(-1, 1)], 1)
            pool_len = book["pool_tok"].size(2)
            # histories end at their last column (left-padded) and are no longer than the pool
            # holds: the last pool_len columns (the others are ended sentences' history)
            hist = hist[:, -pool_len:]
            hist = torch.nn.functional.pad(
                hist.view(n, k, -1), (0, pool_len - hist.size(1)), value=PAD_ID
            )
            norm = top[:, :k] / self._penalties(steps + 1)[:, None]
            merged_norm = torch.cat([book["pool_norm"], torch.where(fin, norm, NEG)], 1)
            merged_raw = torch.cat([book["pool_raw"], top[:, :k]], 1)
            merged_tok = torch.cat([book["pool_tok"], hist], 1)  # [n,2K,L]
            best, pick = merged_norm.topk(k, dim=1)  # [n,K]
            book["pool_norm"] = best
            book["pool_raw"] = merged_raw.gather(1, pick)
            book["pool_tok"] = merged_tok.gather(1, pick[:, :, None].expand(-1, -1, pool_len))
            book["finished"] = book["finished"] + fin.sum(1)
            book["best_ended"] = book["best_ended"] | fin[:, 0]

        # Live: the K best non-EOS expansions. Where fewer than K are not EOS and alive (the
        # length limit forces EOS; a vocabulary under 2K), the rest are picked among dead
        # candidates in an order torch leaves open: an EOS one picked there stays dead.
        live = torch.where(is_eos, NEG, rank).topk(k, dim=1).indices  # [n,K]
        live_scores = torch.where(is_eos, NEG, top).gather(1, live)
        sel_rows = rows.gather(1, live).flatten()  # [n*K]
        sel_tok = tok.gather(1, live).flatten()
        book["scores"] = scores = live_scores
        book["tokens"] = torch.cat([book["tokens"][sel_rows], sel_tok[:, None]], 1)
        book["steps"] = steps = steps + 1
        # Rows stay inside their sentence; the first step expands each sentence to K rows.
        self.state = reorder_state(state, sel_rows)
        self.width = k
        book["prev"] = sel_tok

        # Done: no live hypothesis can beat the worst pooled one (exact bound for alpha >= 0),
        # or the patience quota of finished hypotheses is reached.
        best = scores.max(1).values  # [n] of the live hypotheses; -inf: none left
        if self.quota is None:
            done = book["pool_norm"][:, -1] >= best / book["limit_penalty"]
        elif opts.length_penalty == 0 and k > 1:
            done = book["best_ended"] & (book["finished"] >= opts.nbest)
        else:
            done = book["finished"] >= self.quota
        done = (done | ~(best > NEG)) & book["live"]  # none left (or NaN scores)
        if not done.any():
            return []
        return self._leave(done)

    def _leave(self, done: Tensor) -> list[tuple[object, list[Hypothesis]]]:
        """The n-best lists of the sentences that are done; they die, and the batch drops
        its dead sentences when its live ones fit in fewer rows (`batch_rows`)."""
        book, k = self.book, self.k
        ended = done.nonzero().flatten()
        norms = book["pool_norm"][ended].tolist()
        raws = book["pool_raw"][ended].tolist()
        toks = book["pool_tok"][ended].tolist()
        results = []
        for j, i in enumerate(ended.tolist()):
            hyps = []
            for h in range(min(self.opts.nbest, k)):
                if math.isinf(norms[j][h]):
                    continue
                seq = toks[j][h]
                end = seq.index(EOS_ID) if EOS_ID in seq else len(seq)
                tokens = [x for x in seq[:end] if x != PAD_ID]  # histories are left-padded
                hyps.append(Hypothesis(tokens, norms[j][h], raws[j][h]))
            results.append((self.ids[i], hyps))
            self.ids[i] = None
        self.live -= len(results)
        if not self.live:
            self._reset()
            return results
        book["live"] = book["live"] & ~done
        book["scores"] = book["scores"].masked_fill(done[:, None], NEG)  # no candidates
        # a batch decoded to its end shrinks by the ladder on CPU (few shapes); one that
        # sentences join has shapes as varied as its arrivals: its ended sentences leave now
        cpu = done.device.type == "cpu"
        rows = batch_rows(self.live) if cpu and not self.joined else self.live
        if rows >= len(self.ids):
            return results
        keep = kept_rows(book["live"], self.live, rows)
        keep_rows = (keep[:, None] * k + torch.arange(k, device=keep.device)).flatten()
        for key, x in book.items():
            book[key] = x[keep_rows] if key in ("tokens", "prev") else x[keep]
        longest = int(book["steps"].max())  # history columns still needed
        book["tokens"] = book["tokens"][:, book["tokens"].size(1) - longest :]
        self.state = reorder_state(self.state, keep_rows, sentences=keep)
        self.ids = [self.ids[i] for i in keep.tolist()]
        return results


@decoding
def beam_search(
    model: TranslationModel,
    src: Tensor,
    src_mask: Tensor,
    opts: SearchOptions,
    stop: threading.Event | None = None,
) -> list[list[Hypothesis]]:
    """Beam search of width K over src[B,S] (`BeamStream`); returns the n-best list of every
    sentence. Raises SearchStopped at the next step once `stop` is set."""
    stream = BeamStream(model, opts)
    stream.add(src, src_mask, list(range(src.size(0))))
    results: list[list[Hypothesis]] = [[] for _ in range(src.size(0))]
    while stream:
        _check(stop)
        for i, hyps in stream.step():
            results[i] = hyps
    return results


def search(
    model: TranslationModel,
    src: Tensor,
    src_mask: Tensor,
    opts: SearchOptions,
    stop: threading.Event | None = None,
) -> list[list[Hypothesis]]:
    """Greedy when beam == 1 (or sampling), beam search otherwise. Once `stop` is set, the
    search raises SearchStopped at its next step (a step takes ~50 ms for a batch of 64)."""
    if opts.beam == 1 or opts.sample:
        return greedy(model, src, src_mask, opts, stop)
    return beam_search(model, src, src_mask, opts, stop)


@decoding
def force_decode(
    model: TranslationModel, src: Tensor, src_mask: Tensor, tgt: list[int]
) -> tuple[list[float], Tensor | None]:
    """Score one given target (EOS appended) for src[1,S]: token log-probs and attention [T,S]."""
    state = _start(model, src, src_mask)
    prev = torch.tensor([BOS_ID], device=src.device)
    logps, attn = [], []
    for token in [*tgt, EOS_ID]:
        out, state = model.step(prev, state)
        logps.append(float(step_log_probs(out)[0, token]))
        if out.attention is not None:
            attn.append(out.attention[0].float())
        prev = torch.tensor([token], device=src.device)
    return logps, (torch.stack(attn) if attn else None)
