"""The contract between architectures and everything else (trainer, search, compare).

Every model maps batch-first tensors to batch-first tensors:

- ``forward(src[B,S], src_mask[B,S], tgt_in[B,T]) -> logits[B,T,V]`` (teacher forcing);
- ``encode(src, src_mask) -> State`` (encoder memory and whatever the decoder needs);
- ``init_state(memory: State) -> State`` (the decoder's starting state);
- ``step(prev[B], state) -> (StepOutput, State)`` (one target position, never mutating).

``src_mask`` is boolean, True at real tokens. ``forward`` and ``encode`` also take the source
lengths on the host, ``src_lengths[B]`` (CPU), when the caller knows them (batching does):
models that need lengths on the host (packed RNNs) read them there instead of waiting for the
device to sum the mask; the others ignore them. A ``State`` is a plain dict of tensors whose first
dimension is the batch, so ``reorder_state`` serves beam expansion and pruning for every model.
State entries that are functions of the source alone (encoder memory, attention keys computed
once per sentence, the source mask) are named ``src_*`` and hold one row per sentence. The
other entries hold one row per hypothesis, the hypotheses of a sentence in adjacent rows, the
same number for every sentence: a step on N rows of a state whose ``src_*`` entries have B rows
decodes N // B hypotheses per sentence (`hypotheses_per_sentence`). So beam search never
copies the source side K times, and attention reads each sentence's keys once for all of its
hypotheses.

Entries named ``cache_*`` (a cache that grows by one position per step, such as the
transformer's keys and values) are reordered by the model itself: ``reorder_state`` leaves
them as they are and reorders the per-hypothesis ``rows`` entry, the row of the caches each
hypothesis continues, with everything else; the next step selects those rows while it copies
the cache to extend it (`extend_ragged_cache`, `extend_cache`), so a beam step copies each
cache once, not twice. On CPU in bf16 or fp16 a cache grows by KEY_CHUNK positions at a time
(`cache_size`), zeros past the filled ones, so that attention keeps one shape for several
steps (`key_chunk`).

``join(a, b) -> State`` puts the sentences of two states in one (a's, then b's; the same
number of hypotheses per sentence in both): sentences that start while others are half-way
through their translation decode beside them (in-flight batching, `nmt.search.BeamStream`).
The sources of the two may differ in length and so may the caches: `join_states` pads both at
their ends (zeros, masks False), and a joined cache is *ragged*: the per-hypothesis ``len``
entry says how many of its positions each hypothesis has filled, the rest being zeros that
the model masks (`extend_ragged_cache`). Sentences that join with empty caches beside filled
ones get no cache row (``rows`` NO_ROW) and a's caches are kept, not copied; the next step
starts their rows with zeros (a server's stream joins a sentence or two at most steps; not
copying the running batch's caches then made it 3-4% faster). Every hypothesis' real
positions start at 0, so a sentence computes the same sums in a joined batch as alone, only
followed by zeros.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

State = dict[str, Tensor]


@dataclass(frozen=True)
class Vocab:
    """What a model needs to know about the tokenizer."""

    src_size: int
    tgt_size: int
    shared: bool  # one joint vocabulary: embeddings may be tied


@dataclass
class StepOutput:
    logits: Tensor  # [B, V] next-token scores (unnormalised); the search may overwrite them
    # weights over source positions, [B, S] or one row per attention head [B, H, S]; None
    # without attention
    weights: Tensor | None
    # [B, V] the model's own next-token log-probabilities, used as they are when given (an
    # ensemble's mean of its members', not renormalised); else log_softmax(logits)
    log_probs: Tensor | None = None

    @property
    def attention(self) -> Tensor | None:
        """[B, S] the step's weights over source positions, averaged over heads: made when
        asked (a search never asks; scoring a given target for its picture does). A beam-5
        step of 16 sentences spent 78 us of its 8.5 ms averaging them (compiled, 1 thread)."""
        w = self.weights
        return w.mean(1) if w is not None and w.dim() == 3 else w


def step_log_probs(out: StepOutput) -> Tensor:
    """A step's next-token log-probabilities [N,V] in fp32: `out.log_probs` when the model
    gives them, else the log_softmax of its logits. On CPU without autograd it is written over
    fp32 logits (the search owns a step's output: in place, the [320,8000] rows of a beam-5
    step take 1.3 ms instead of 1.9 ms on 1 thread, and the step needs 10 MB less memory), and
    over their fp32 cast when they are bf16 or fp16: the same values as log_softmax's `dtype`
    argument, which casts into one buffer and writes another ([320,8000] bf16: 1.8 ms, not 2.4)."""
    if out.log_probs is not None:
        return out.log_probs.float()
    logits = out.logits
    if logits.device.type == "cpu" and not logits.requires_grad:
        logits = logits.float()  # the same tensor when fp32
        return torch.log_softmax(logits, -1, out=logits)
    return torch.log_softmax(logits, -1, dtype=torch.float32)


class TranslationModel(Protocol):
    def forward(
        self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, src_lengths: Tensor | None = None
    ) -> Tensor: ...

    def encode(self, src: Tensor, src_mask: Tensor, src_lengths: Tensor | None = None) -> State: ...

    def init_state(self, memory: State) -> State: ...

    def step(self, prev: Tensor, state: State) -> tuple[StepOutput, State]: ...

    def join(self, a: State, b: State) -> State: ...

    def parameters(self): ...

    def modules(self): ...

    def eval(self): ...


SOURCE_PREFIX = "src_"
CACHE_PREFIX = "cache_"
CACHE_ROWS = "rows"
CACHE_LENGTHS = "len"  # per hypothesis, in ragged states only: its filled cache positions
NO_ROW = -1  # a hypothesis' cache row when it has none yet: it starts with an empty cache
# Attention keys whose products oneDNN computes come in whole chunks of this many positions
# (the transformer's caches grow by a chunk at a time, `cache_size`; source keys are padded
# to a chunk): oneDNN makes and keeps ~0.7 MB of kernels for every shape it sees.
KEY_CHUNK = 8


def source_state(state: State) -> State:
    """The ``src_*`` entries of a state: what every decoding step carries over unchanged."""
    return {k: v for k, v in state.items() if k.startswith(SOURCE_PREFIX)}


def reorder_state(state: State, index: Tensor, sentences: Tensor | None = None) -> State:
    """Select (and repeat) hypothesis rows of every state tensor: beam expansion and pruning.

    `index` selects the rows of the per-hypothesis entries; `sentences` the rows of the
    per-sentence ``src_*`` entries, which stay as they are when it is None (hypotheses
    reordered or multiplied within their sentences). The result must keep the hypotheses of a
    sentence adjacent and in sentence order. ``cache_*`` entries stay as they are: their
    rows follow through the ``rows`` entry (see the module docstring).
    """
    out = {}
    for k, v in state.items():
        if k.startswith(SOURCE_PREFIX):
            out[k] = v if sentences is None else v.index_select(0, sentences)
        elif k.startswith(CACHE_PREFIX):
            out[k] = v
        else:
            out[k] = v.index_select(0, index)
    return out


def extend_cache(cache: Tensor, rows: Tensor, new: Tensor, dim: int) -> Tensor:
    """The cache's rows `rows` with `new` (one row per entry of `rows`) appended along `dim`:
    ``torch.cat([cache.index_select(0, rows), new], dim)``, where every row has filled the
    whole cache (the transformer where its keys are not chunked, `key_chunk` 1; else it writes
    into chunks, `extend_ragged_cache`). On CPU without autograd the rows are selected straight
    into the result, one copy instead of two: [320,4,20,64] fp32 took 0.30 ms instead of 0.58
    ms (1 thread), the same values."""
    if cache.device.type != "cpu" or torch.is_grad_enabled():
        return torch.cat([cache.index_select(0, rows), new], dim)
    filled = cache.size(dim)
    out = new.new_empty((*new.shape[:dim], filled + 1, *new.shape[dim + 1 :]))
    torch.index_select(cache, 0, rows, out=out.narrow(dim, 0, filled))
    out.narrow(dim, filled, 1).copy_(new)
    return out


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def key_chunk(keys: Tensor) -> int:
    """The positions attention keys like `keys` come in: KEY_CHUNK where oneDNN computes
    their products (CPU, bf16 or fp16), which makes kernels for every shape; else 1. fp32
    products (and int8 decoding's attention, in fp32) run on MKL's sgemm, which keeps none
    (oneDNN's verbose log shows no fp32 bmm), so there padding is only work: beam 5 in fp32 over
    1,000 test sentences, one process, passes alternating, median of 4: 123.4 sentences/s with
    whole keys, 122.3 with chunks (within noise), the same translations."""
    low = keys.dtype in (torch.bfloat16, torch.float16)
    return KEY_CHUNK if keys.device.type == "cpu" and low else 1


def cache_size(filled: int, chunk: int) -> int:
    """Positions of a cache that must hold `filled` + 1: rounded up to a multiple of `chunk`
    (see `extend_ragged_cache`)."""
    return round_up(filled + 1, chunk)


def extend_ragged_cache(
    cache: Tensor,
    rows: Tensor,
    new: Tensor,
    lengths: Tensor | None,
    size: int,
    dim: int,
    filled: int,
    empty: Tensor | None = None,
) -> Tensor:
    """A ragged cache's rows `rows`, each with its `new` entry (one position along `dim`)
    written at its own length (`lengths` [N], at most `filled`; None: all `filled`): a cache
    of `size` positions along `dim` (at least `filled` + 1), zero past each row's filled ones.
    `cache` must be zero past each row's filled positions too (it is copied whole when it is
    no longer than `size`: a faster copy than of its first `filled` positions). A `size` above
    `filled` + 1 (`cache_size`) keeps one shape for several steps. `empty` [n'] lists the
    hypotheses whose row is NO_ROW (they joined with an empty cache): theirs start as zeros."""
    # whole rows (contiguous: a faster copy) unless the cache shrinks; past `filled`: zeros
    n, keep = rows.numel(), cache.size(dim) if cache.size(dim) <= size else filled
    shape = (*new.shape[:dim], size, *new.shape[dim + 1 :])
    kept = cache.narrow(dim, 0, keep)
    if empty is not None:  # hypotheses without a row (NO_ROW): any row's copy, then zeros
        rows = rows.clamp(min=0)
    if cache.device.type == "cpu" and not torch.is_grad_enabled():
        out = new.new_empty(shape)
        torch.index_select(kept, 0, rows, out=out.narrow(dim, 0, keep))
        out.narrow(dim, keep, size - keep).zero_()
        if empty is not None:
            out.index_fill_(0, empty, 0)
    else:
        pad = new.new_zeros((*shape[:dim], size - keep, *shape[dim + 1 :]))
        out = torch.cat([kept.index_select(0, rows), pad], dim)
        if empty is not None:
            out = out.index_fill(0, empty, 0)
    if lengths is None:  # every row writes at `filled`
        if out.requires_grad or new.requires_grad:
            return torch.cat(
                [out.narrow(dim, 0, filled), new, out.narrow(dim, filled + 1, size - filled - 1)],
                dim,
            )
        out.narrow(dim, filled, 1).copy_(new)
        return out
    value = new.select(dim, 0)  # [N, ...]: the new entries without their position dimension
    at = (torch.arange(n, device=new.device), lengths)  # (row, position) of each new entry
    if out.requires_grad or value.requires_grad:  # autograd: out of place
        return out.movedim(dim, 1).index_put(at, value).movedim(1, dim)
    out.movedim(dim, 1)[at] = value  # a view of out: written in place
    return out


def grow_cache(cache: Tensor, rows: Tensor, new: Tensor, lengths: Tensor, dim: int) -> Tensor:
    """`extend_ragged_cache` as `torch.compile` takes it into one graph for every step: the
    cache's rows `rows` (NO_ROW: zeros), each row's `new` entry written at its `lengths`, in a
    cache already of the step's size (`fit_cache`), with nothing read back to the host (which
    rows have none, how far the rows fill). The same values."""
    kept = cache.index_select(0, rows.clamp(min=0))
    grown = kept * (rows != NO_ROW).to(kept.dtype).view(-1, *[1] * (cache.dim() - 1))
    at = (torch.arange(rows.size(0), device=rows.device), lengths)  # (row, position)
    grown.movedim(dim, 1)[at] = new.select(dim, 0)  # a view of grown: written in place
    return grown


def fit_cache(cache: Tensor, size: int, dim: int) -> Tensor:
    """The cache with `size` positions along `dim`, contiguous: cut (past the longest row's
    length all is zeros) or padded with zeros."""
    if cache.size(dim) > size:
        return cache.narrow(dim, 0, size).contiguous()
    return pad_end(cache, dim, size)


def pad_end(x: Tensor, dim: int, size: int) -> Tensor:
    """x padded at the end of `dim` to `size` with zeros (False for masks)."""
    if x.size(dim) >= size:
        return x
    shape = (*x.shape[:dim], size - x.size(dim), *x.shape[dim + 1 :])
    return torch.cat([x, x.new_zeros(shape)], dim)


def join_states(
    a: State, b: State, lengths: dict[str, int], chunked: tuple[str, ...] = (), chunk: int = 1
) -> State:
    """The state of a's sentences followed by b's (the same hypotheses per sentence in
    both; see the module docstring): every entry of the two concatenated along dimension 0,
    those named in `lengths` first padded to the longer of the two along the dimension it
    gives (the source positions of ``src_*`` entries, the positions of ``cache_*`` ones). The
    ``src_*`` ones hold as many positions as the longest source of the two (``src_mask``):
    sentences that have left a batch leave no padding behind them; those in `chunked` (keys
    attention reads, and their mask) a whole number of `chunk` positions. b's ``rows`` point past
    a's cache rows; when b's caches are empty and a's are not, the caches are a's (no copy)
    and b's ``rows`` are NO_ROW. When the caches' filled lengths differ, the result has the
    per-hypothesis ``len`` entry (a ragged state)."""
    if set(a) - {CACHE_LENGTHS} != set(b) - {CACHE_LENGTHS}:
        raise ValueError(f"cannot join states with entries {sorted(a)} and {sorted(b)}")
    # a cache (they all have the same rows and positions) and the dimension of its positions
    cache = next((k for k in a if k.startswith(CACHE_PREFIX)), None)
    at = lengths[cache] if cache is not None else 0
    # b's caches hold nothing yet (its sentences start now) and a's do: a's are kept as they
    # are, b's hypotheses have no row in them (NO_ROW), and no copy of a's is made
    unfilled = cache is not None and b[cache].size(at) == 0 < a[cache].size(at)
    longest = None  # source positions of the longest source in a or b
    if "src_mask" in a:
        longest = int(max(a["src_mask"].sum(1).max(), b["src_mask"].sum(1).max()))
    out: State = {}
    for key, x in a.items():
        if key == CACHE_LENGTHS:
            continue
        y = b[key]
        if unfilled and key.startswith(CACHE_PREFIX):
            out[key] = x  # b's hypotheses have no row in it (NO_ROW)
            continue
        if key in lengths:
            dim = lengths[key]
            size = max(x.size(dim), y.size(dim))
            if longest is not None and key.startswith(SOURCE_PREFIX):
                size = round_up(longest, chunk if key in chunked else 1)
                x, y = (
                    x.narrow(dim, 0, min(size, x.size(dim))),
                    y.narrow(dim, 0, min(size, y.size(dim))),
                )
            x, y = pad_end(x, dim, size), pad_end(y, dim, size)
        elif key == CACHE_ROWS:
            y = y.new_full(y.shape, NO_ROW) if unfilled else y + a[cache].size(0)
        out[key] = torch.cat([x, y])
    if cache is not None:
        filled = [
            s[CACHE_LENGTHS]
            if CACHE_LENGTHS in s
            else s[CACHE_ROWS].new_full(s[CACHE_ROWS].shape, s[cache].size(at))
            for s in (a, b)
        ]
        if CACHE_LENGTHS in a or CACHE_LENGTHS in b or a[cache].size(at) != b[cache].size(at):
            out[CACHE_LENGTHS] = torch.cat(filled)
    return out


def hypotheses_per_sentence(rows: int, per_sentence: Tensor) -> int:
    """How many hypothesis rows (of `rows`) each sentence has, given a ``src_*`` entry."""
    sentences = per_sentence.size(0)
    if sentences == 0 or rows % sentences:
        raise ValueError(f"{rows} hypothesis rows cannot be shared by {sentences} sentences")
    return rows // sentences


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class WeightCache:
    """A module that may keep copies derived from its weights (packed into a kernel's layout,
    cast to a compute dtype) while `fixed_weights(model)` says those weights do not change.
    `weight_cache` is the scope's dict for them (keyed as the module likes), None outside a
    scope: the copies live exactly as long as the outermost scope."""

    _fixed_depth = 0  # depth of the enclosing fixed_weights scopes

    @property
    def weight_cache(self) -> dict | None:
        return self.__dict__.get("_weight_cache")


_scopes = threading.Lock()  # fixed_weights scopes may open and close in several threads


@contextlib.contextmanager
def fixed_weights(model: torch.nn.Module) -> Iterator[None]:
    """A scope in which the model's weights do not change (decoding): its `WeightCache`
    modules keep what they derive from their weights until the outermost scope ends, so no
    optimizer step or state dict load can leave a stale copy behind. Decoding threads may
    open scopes on one model at once."""
    caches = [m for m in model.modules() if isinstance(m, WeightCache)]
    with _scopes:
        for m in caches:
            m._fixed_depth += 1
            if m.weight_cache is None:
                m.__dict__["_weight_cache"] = {}
    try:
        yield
    finally:
        with _scopes:
            for m in caches:
                m._fixed_depth -= 1
                if not m._fixed_depth:
                    m.__dict__.pop("_weight_cache", None)
