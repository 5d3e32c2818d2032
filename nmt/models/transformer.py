"""Transformer encoder-decoder (Vaswani et al. 2017) with an incremental key/value cache.

Attention is softmax(QKᵀ/√d)V: through `torch.nn.functional.scaled_dot_product_attention` over
whole sequences (training, encoding), written out for the few queries of a decoding step
(`attend_step`).
Decoding state: per layer, the self-attention cache `cache_k{i}`/`cache_v{i}` [N,H,t,Dh] of the
N hypotheses grows by one position per step (`rows` says which cache row each hypothesis
continues, see `nmt.models.base`); the cross-attention keys/values `src_k{i}`/`src_v{i}`
[B,H,S,Dh] are computed once per sentence in `init_state`, and the hypotheses of a sentence
query them together. A joined state (`join`) may be ragged: its hypotheses have filled
`len` [N] positions of the cache each, the rest zeros that self-attention masks. On CPU in
bf16 (or fp16) the caches and the source keys `src_keys_mask` [B,S'] come in whole chunks of
KEY_CHUNK positions (zeros, masked) so that attention keeps a few shapes
(`nmt.models.base.key_chunk`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nmt.models.base import (
    CACHE_LENGTHS,
    CACHE_ROWS,
    KEY_CHUNK,
    NO_ROW,
    State,
    StepOutput,
    cache_size,
    extend_cache,
    extend_ragged_cache,
    fit_cache,
    grow_cache,
    hypotheses_per_sentence,
    join_states,
    key_chunk,
    pad_end,
    round_up,
    source_state,
)
from nmt.models.layers import Dropout, Embedding, Linear, OutputProjection, Positions, softmax


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    dropout: float = 0.0,
) -> Tensor:
    """softmax(QKᵀ/√Dh)V with SDPA. q[B,H,Tq,Dh], k/v[B,H,Tk,Dh], mask[B,1,1,Tk] -> [B,H,Tq,Dh].

    On CPU in reduced precision, SDPA's flash kernel is several times slower than its math
    kernel at translation lengths (measured 114 ms vs 30 ms fwd+bwd for [461,4,13,64] bf16),
    so the math backend is chosen there.
    """
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal
            )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal
    )


def attend_step(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """A few queries per row (incremental decoding: one position, or the hypotheses of one
    sentence against its source): q[B,H,Tq,Dh], k/v[B,H,S,Dh], mask[B,1,1,S] bool or None
    -> y[B,H,Tq,Dh] and the weights [B,H,Tq,S] (fp32).

    softmax(QKᵀ/√Dh)V written out as two 3-d batched matmuls, the softmax in fp32. For a
    single query this beats SDPA on CPU, whose kernels are built for many queries: [320,4,1,64]
    against 20 keys took 0.5 ms in bf16 (SDPA math 1.1 ms, flash 2.2 ms) and 0.31 ms in fp32
    (math 0.85 ms, flash 0.52 ms); and the weights come for free, for attention plots. The 3-d
    form (k and v contiguous, so the reshapes are views) skips `matmul`'s 4-d dispatch:
    beam 5 in bf16 went from 145 to 147 sentences/s.
    """
    b, h, tq, dh = q.shape
    s = k.size(2)
    # On CPU, compiled code takes the broadcast products at every size (inductor's own loops,
    # see small_attend_step) and asks nothing of its shapes (a size compared would guard its
    # graphs); eager code takes them in fp32 below ATen's scalar-loop size.
    if q.device.type == "cpu" and (
        torch.compiler.is_compiling() or (q.dtype == torch.float32 and tq * s * dh < SMALL_PRODUCT)
    ):
        return small_attend_step(q, k, v, mask)
    keys = k.reshape(b * h, s, dh).transpose(1, 2)
    # baddbmm's input, ignored with beta=0 on CPU and CUDA; zeros, not empty memory, because
    # MPS computes beta * input anyway (0 * NaN = NaN; pytorch issues 187521 and 194442)
    ignored = torch.zeros((), dtype=q.dtype, device=q.device).expand(b * h, tq, s)
    scores = torch.baddbmm(ignored, q.reshape(b * h, tq, dh), keys, beta=0, alpha=dh**-0.5)
    scores = scores.view(b, h, tq, s)  # [B,H,Tq,S], scaled inside the matmul
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = softmax(scores, torch.float32)
    y = torch.bmm(weights.to(v.dtype).view(b * h, tq, s), v.reshape(b * h, s, dh))
    return y.view(b, h, tq, dh), weights  # [B,H,Tq,S] @ [B,H,S,Dh] -> [B,H,Tq,Dh]


# ATen computes a batched product of fewer multiply-adds than this (m * n * k) with a scalar
# loop instead of a BLAS kernel (`bmm_out_or_baddbmm_`, torch 2.13)
SMALL_PRODUCT = 400


def small_attend_step(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """`attend_step` in fp32 on CPU where its products are small enough for ATen's scalar
    loop: a query against the first 6 positions of a cache of 64-wide heads (the first steps
    of fp32 and int8 decoding, whose caches grow by one position; in bf16 they grow by 8).
    Broadcast products summed instead, the same softmax: 1 thread, 200 hypotheses x 4 heads,
    84 against 222 us at 1 position, 221 against 625 us at 4, 265 against 718 us at 6. The
    same values up to the summation order (outputs within 1.1e-6, weights within 3e-7).

    Also what code `torch.compile` traces on CPU runs, at any size and in bf16 too: inductor
    makes the products, the softmax and the cache writes before them a few loops of its own
    (bf16 products summed in fp32, rounded once), where the batched products stay calls of
    their own to ATen's small batched GEMMs. 16 sentences in flight, beam 5, bf16, 1 thread,
    Zen 4, passes of 300 alternating, with the log-softmax in the graph too
    (`compiled_layers`): 82.9, 89.1, 88.3, 87.3 against 79.9, 84.0, 84.6, 83.4 sentences/s."""
    dh = q.size(-1)
    scores = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * dh**-0.5  # [B,H,Tq,S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = softmax(scores, torch.float32)
    y = (weights.to(v.dtype)[..., None] * v[:, :, None, :, :]).sum(-2)  # [B,H,Tq,Dh]
    return y, weights


def split_heads(x: Tensor, heads: int) -> Tensor:
    b, t, d = x.shape
    return x.view(b, t, heads, d // heads).transpose(1, 2)  # [B,T,D] -> [B,H,T,Dh]


def merge_heads(x: Tensor) -> Tensor:
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)  # [B,H,T,Dh] -> [B,T,D]


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection."""

    def __init__(self, dim: int, heads: int, attn_dropout: float) -> None:
        super().__init__()
        self.qkv = Linear(dim, 3 * dim)
        self.out = Linear(dim, dim)
        self.heads = heads
        self.attn_dropout = attn_dropout

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [B,T,D] x3
        return split_heads(q, self.heads), split_heads(k, self.heads), split_heads(v, self.heads)

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """x[B,T,D]; mask[B,1,1,T] bool (True = attend) -> [B,T,D]."""
        q, k, v = self.project(x)
        p = self.attn_dropout if self.training else 0.0
        y = attend(q, k, v, mask, causal, p)
        return self.out(merge_heads(y))  # softmax(QKᵀ/√Dh)V: [B,H,T,Dh] -> [B,T,D]


class CrossAttention(nn.Module):
    """Multi-head attention from decoder queries to encoder memory (fused KV projection)."""

    def __init__(self, dim: int, heads: int, attn_dropout: float) -> None:
        super().__init__()
        self.q = Linear(dim, dim)
        self.kv = Linear(dim, 2 * dim)
        self.out = Linear(dim, dim)
        self.heads = heads
        self.attn_dropout = attn_dropout

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv(memory).chunk(2, dim=-1)  # [B,S,D] x2
        return split_heads(k, self.heads), split_heads(v, self.heads)  # [B,H,S,Dh]

    def forward(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """x[B,T,D], k/v[B,H,S,Dh], mask[B,1,1,S] -> [B,T,D]."""
        q = split_heads(self.q(x), self.heads)  # [B,H,T,Dh]
        p = self.attn_dropout if self.training else 0.0
        y = attend(q, k, v, mask, dropout=p)
        return self.out(merge_heads(y))

    def step(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """One decoder position of w hypotheses per sentence, x[B*w,1,D] (a sentence's rows
        adjacent), against its source's k/v[B,H,S,Dh], mask[B,1,1,S] -> y[B*w,1,D] and the
        weights [B*w,H,S] (fp32). The w hypotheses are w queries of one attention, so the
        source keys are read once per sentence, not once per hypothesis."""
        n, _, d = x.shape
        b = k.size(0)
        w = n // b
        q = self.q(x).view(b, w, self.heads, d // self.heads).transpose(1, 2)  # [B,H,w,Dh]
        y, weights = attend_step(q, k, v, mask)  # [B,H,w,Dh], [B,H,w,S]
        y = y.transpose(1, 2).reshape(n, 1, d)
        return self.out(y), weights.transpose(1, 2).reshape(n, self.heads, weights.size(-1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, activation: str, dropout: float) -> None:
        super().__init__()
        self.inner = Linear(dim, ffn_dim)
        self.outer = Linear(ffn_dim, dim)
        self.relu = activation == "relu"
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inner(x, relu=True) if self.relu else F.gelu(self.inner(x))
        return self.outer(self.dropout(h))


class Residual(nn.Module):
    """x + dropout(f(norm(x))) for pre-LN, norm(x + dropout(f(x))) for post-LN."""

    def __init__(self, dim: int, pre_norm: bool, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.pre_norm = pre_norm
        self.dropout = Dropout(dropout)

    def inner(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.pre_norm else x

    def outer(self, x: Tensor, y: Tensor) -> Tensor:
        out = x + self.dropout(y)
        return out if self.pre_norm else self.norm(out)


class EncoderLayer(nn.Module):
    def __init__(
        self,
        dim: int,
        heads: int,
        ffn: int,
        act: str,
        pre: bool,
        drop: float,
        adrop: float,
        fdrop: float,
    ):
        super().__init__()
        self.attn = SelfAttention(dim, heads, adrop)
        self.ffn = FeedForward(dim, ffn, act, fdrop)
        self.res_attn = Residual(dim, pre, drop)
        self.res_ffn = Residual(dim, pre, drop)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.res_attn.outer(x, self.attn(self.res_attn.inner(x), mask))
        return self.res_ffn.outer(x, self.ffn(self.res_ffn.inner(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        dim: int,
        heads: int,
        ffn: int,
        act: str,
        pre: bool,
        drop: float,
        adrop: float,
        fdrop: float,
    ):
        super().__init__()
        self.self_attn = SelfAttention(dim, heads, adrop)
        self.cross_attn = CrossAttention(dim, heads, adrop)
        self.ffn = FeedForward(dim, ffn, act, fdrop)
        self.res_self = Residual(dim, pre, drop)
        self.res_cross = Residual(dim, pre, drop)
        self.res_ffn = Residual(dim, pre, drop)

    def forward(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Teacher forcing: x[B,T,D] with causal self-attention."""
        x = self.res_self.outer(x, self.self_attn(self.res_self.inner(x), causal=True))
        x = self.res_cross.outer(x, self.cross_attn(self.res_cross.inner(x), k, v, mask))
        return self.res_ffn.outer(x, self.ffn(self.res_ffn.inner(x)))

    def step(
        self,
        x: Tensor,
        cache_k: Tensor,
        cache_v: Tensor,
        extend: Callable[[Tensor, Tensor], Tensor],
        k: Tensor,
        v: Tensor,
        mask: Tensor,
        self_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One position x[N,1,D] of N hypotheses against the caches [M,H,t,Dh] and their
        sentences' source k/v[B,H,S,Dh] -> y, the extended caches [N,H,t',Dh], and the
        cross-attention weights [N,H,S]. `extend(cache, new)` gives a cache with each
        hypothesis' row and its new position [N,H,1,Dh] (`Transformer.step` says how);
        `self_mask` [N or 1,1,1,t'] its filled positions (None: all)."""
        q, k_new, v_new = self.self_attn.project(self.res_self.inner(x))  # [N,H,1,Dh]
        cache_k, cache_v = extend(cache_k, k_new), extend(cache_v, v_new)
        y, _ = attend_step(q, cache_k, cache_v, self_mask)
        x = self.res_self.outer(x, self.self_attn.out(merge_heads(y)))
        y, weights = self.cross_attn.step(self.res_cross.inner(x), k, v, mask)
        x = self.res_cross.outer(x, y)
        x = self.res_ffn.outer(x, self.ffn(self.res_ffn.inner(x)))
        return x, cache_k, cache_v, weights


# graphs torch.compile may make of `compiled_layers` (per model: an ensemble's members each)
COMPILED_VARIANTS = 64
# `compile_decoding`'s inductor settings: the weights frozen into inference graphs as constants
# (packed for oneDNN's products, as eager decoding packs them; graphs with autograd are not
# frozen), and a C++ wrapper around the kernels (less Python a call). A step's layers with 16
# sentences in flight (beam 5, bf16, 1 thread, Zen 4): 8.3 ms eager, 8.6 compiled, 7.2 frozen,
# 6.8 frozen with the C++ wrapper.
INDUCTOR = {"freezing": True, "cpp_wrapper": True}
# ... and its settings of symbolic shapes. After `NMTEngine.warm_up`, a stream of 300 test
# sentences made 5 graphs more (tens of seconds each, under load) with duck sizing off alone;
# none with size-oblivious sizes too and the caches fit to the step outside the graph.
SHAPES = {"use_duck_shape": False, "backed_size_oblivious": True}


def compiled_layers(
    model: Transformer,
    x: Tensor,
    caches: list[Tensor],
    sources: list[Tensor],
    keys_mask: Tensor,
    rows: Tensor,
    lengths: Tensor,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """`Transformer.decode_layers` as `torch.compile` takes it (`compile_decoding`): every
    hypothesis writes its position `lengths` [N] (ragged) into caches already of the step's t'
    positions (`fit_cache`), continuing its cache row `rows` [N] (NO_ROW: none yet), with no
    value read back to the host, so that one graph serves every step (`grow_cache`). Returns
    the next-token log-probabilities [N,V] (fp32, as `step_log_probs` makes them of the
    logits: the log-softmax one more kernel of the graph, fused with the cast, instead of two
    passes of ATen's over the [N,8000] logits after it), not the logits."""
    positions = torch.arange(caches[0].size(2), device=x.device)
    past = (positions <= lengths[:, None])[:, None, None, :]  # [N,1,1,t']

    def extend(cache: Tensor, new: Tensor) -> Tensor:
        return grow_cache(cache, rows, new, lengths, 2)

    logits, weights, extended = model.decode_layers(x, caches, sources, keys_mask, extend, past)
    return torch.log_softmax(logits.float(), -1), weights, extended


def unbacked_batches(fn: Callable, args: tuple) -> None:
    """The batch sizes of a compiled call's tensors marked unbacked (`mark_unbacked`): sizes
    the graph never compares with 1, as inductor's own lowering of a view of a strided buffer
    (a chunk of the fused QKV projection, the heads merged) compares backed sizes, however
    size-oblivious the trace (`SHAPES`, torch 2.13). Backed, a batch of one sentence, and a
    step of one hypothesis per sentence or one row, made graphs of their own: 6 in
    `NMTEngine.warm_up`, not 2. Tensors of one size share one symbol (`shape_id`): the
    sentences, a step's rows, and the caches' rows before it (the rows of the last step).
    Marks only: 1.7 us a tensor, about 30 a step of 6 layers. Not where this torch's
    `mark_unbacked` has no `shape_id` (an older one): there the graphs stay backed."""
    mark = unbacked_marker()
    if mark is None:
        return
    if fn is encode_and_start:  # src [B,S], src_mask [B,S]
        groups = {"sentences": args}
    else:  # compiled_layers
        x, caches, sources, keys_mask, rows, lengths = args
        groups = {"rows": [x, rows, lengths], "cached": caches, "sentences": [*sources, keys_mask]}
    for shape_id, tensors in groups.items():
        for t in tensors:
            mark(t, 0, shape_id=shape_id)


@functools.cache
def unbacked_marker() -> Callable | None:
    """torch's `mark_unbacked` where it takes a `shape_id`, else None."""
    from torch._dynamo import decorators

    mark = getattr(decorators, "mark_unbacked", None)
    if mark is None or "shape_id" not in inspect.signature(mark).parameters:
        return None
    return mark


def encode_source(model: Transformer, src: Tensor, src_mask: Tensor) -> State:
    """`Transformer.encode`: the encoder's memory [B,S,D] of src[B,S]."""
    positions = torch.arange(src.size(1), device=src.device)
    x = model._embed(model.src_embed, src, positions)  # [B,S,D]
    mask = src_mask[:, None, None, :]  # [B,1,1,S]
    for layer in model.encoder:
        x = layer(x, mask)
    return {"memory": model.enc_norm(x), "src_mask": src_mask}


def start_decoder(model: Transformer, memory: State) -> State:
    """`Transformer.init_state`: the source keys and values of every decoder layer, computed
    once per sentence, and empty caches."""
    mem = memory["memory"]  # [B,S,D]
    b = mem.size(0)
    dh = model.d_model // model.heads
    state: State = {
        "src_mask": memory["src_mask"],
        "pos": mem.new_zeros(b, dtype=torch.long),
        CACHE_ROWS: torch.arange(b, device=mem.device),
    }
    kv = [layer.cross_attn.memory_kv(mem) for layer in model.decoder]  # once per sentence
    # the source keys in whole chunks where the caches grow by chunks (masked, `key_chunk`);
    # compiled code takes them as they are (a graph for any length)
    keys = mem.size(1)
    if not torch.compiler.is_compiling():
        keys = round_up(keys, key_chunk(kv[0][0]))
    state["src_keys_mask"] = pad_end(memory["src_mask"], 1, keys)  # [B,S'] True: a token
    for i, (k, v) in enumerate(kv):
        k, v = pad_end(k.contiguous(), 2, keys), pad_end(v.contiguous(), 2, keys)
        state[f"src_k{i}"], state[f"src_v{i}"] = k, v
        state[f"cache_k{i}"] = k.new_zeros(b, model.heads, 0, dh)  # empty cache [B,H,0,Dh]
        state[f"cache_v{i}"] = k.new_zeros(b, model.heads, 0, dh)
    return state


def encode_and_start(model: Transformer, src: Tensor, src_mask: Tensor) -> State:
    """`encode_source` and `start_decoder` in one function, which `compile_decoding` makes
    one graph (a sentence joining a running batch costs one compiled call, not two): the
    decoder's start state with the encoder's memory beside it (`Transformer.init_state`
    takes the start as it is)."""
    memory = encode_source(model, src, src_mask)
    return {**start_decoder(model, memory), "memory": memory["memory"]}


class Transformer(nn.Module):
    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        d_model: int,
        heads: int,
        enc_layers: int,
        dec_layers: int,
        ffn_dim: int,
        dropout: float,
        attn_dropout: float,
        activation_dropout: float,
        activation: str,
        norm: str,
        positions: str,
        max_positions: int,
        scale_embeddings: bool,
        share_embeddings: bool,
        tie_output: bool,
    ) -> None:
        super().__init__()
        pre = norm == "pre"
        self.src_embed = Embedding(src_vocab, d_model, scale_embeddings)
        if share_embeddings:  # joint vocabulary: one table for source and target
            self.tgt_embed = self.src_embed
        else:
            self.tgt_embed = Embedding(tgt_vocab, d_model, scale_embeddings)
        self.positions = Positions(positions, max_positions, d_model)
        self.dropout = Dropout(dropout)
        args = (d_model, heads, ffn_dim, activation, pre, dropout, attn_dropout, activation_dropout)
        self.encoder = nn.ModuleList(EncoderLayer(*args) for _ in range(enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(*args) for _ in range(dec_layers))
        self.enc_norm = nn.LayerNorm(d_model) if pre else nn.Identity()
        self.dec_norm = nn.LayerNorm(d_model) if pre else nn.Identity()
        self.output = OutputProjection(d_model, tgt_vocab, self.tgt_embed if tie_output else None)
        self.heads = heads
        self.d_model = d_model

    # `compile_decoding`: the compiled versions of the functions a decoding calls
    _compiled: dict[Callable, Callable] | None = None

    def compile_decoding(self) -> None:
        """Decode through `torch.compile`d code: the encoder with the decoder's start
        (`encode_and_start`) and the decoder layers, output projection and
        log-softmax of a step (`compiled_layers`), each one graph over dynamic shapes with the
        weights frozen into it (inductor's freezing) and a C++ wrapper. Call it only on a model
        whose weights no longer change (one loaded to decode): the graphs hold the weights as
        constants. The first calls compile, seconds to minutes each; the batch sizes are
        unbacked (`unbacked_batches`), so a batch of one sentence or a step of one hypothesis
        per sentence uses the same two graphs (`NMTEngine.warm_up` meets them). The same
        translations as eager decoding up to rounding."""
        from torch.fx.experimental import _config as shapes_config

        dynamo = torch._dynamo.config
        limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, limit, max(getattr(dynamo, limit), COMPILED_VARIANTS))
        # floats the code reads (module attributes: a layer norm's eps, an embedding's
        # norm_type) are the graphs' constants from the start; traced as symbols (torch's
        # default), they sent each graph back to be traced again as constants (a restart);
        # where this torch has the setting (an older one specializes them)
        if hasattr(dynamo, "specialize_float"):
            dynamo.specialize_float = True
        # the process' settings: torch.compile's `options` do not reach freezing (torch 2.13),
        # and a patch around each call would race between decoding threads
        for key, value in INDUCTOR.items():
            setattr(torch._inductor.config, key, value)
        # how dynamic shapes are traced: sizes equal by chance stay separate symbols (no guard
        # that they are equal), and a size of 1 does not specialize a graph where it need not
        for key, value in SHAPES.items():
            setattr(shapes_config, key, value)
        # Autocast keeps casts of weights that require grad in one cache for all threads, which
        # it clears, under its lock, at each autocast's exit; tracing puts fake tensors there,
        # whose release needs Python's lock: a decoding thread clearing it while another traced
        # under autocast deadlocked (torch 2.13). Weights that require no grad are not cached.
        self.requires_grad_(False)
        self._compiled = {
            fn: torch.compile(fn, dynamic=True) for fn in (encode_and_start, compiled_layers)
        }

    def _call(self, fn: Callable, *args: object) -> object:
        """fn(self, *args), compiled once `compile_decoding` has compiled it."""
        compiled = (self._compiled or {}).get(fn)
        if compiled is None:
            return fn(self, *args)
        unbacked_batches(fn, args)
        return compiled(self, *args)

    def _embed(self, embed: Embedding, ids: Tensor, positions: Tensor) -> Tensor:
        return self.dropout(embed(ids) + self.positions(positions))  # [B,T,D]

    # -- contract --------------------------------------------------------------------------
    def encode(self, src: Tensor, src_mask: Tensor, src_lengths: Tensor | None = None) -> State:
        fn = encode_and_start if self._compiled is not None else encode_source
        return self._call(fn, src, src_mask)  # type: ignore[return-value]

    def init_state(self, memory: State) -> State:
        if "pos" in memory:  # started with its encoding (`encode_and_start`)
            return {k: v for k, v in memory.items() if k != "memory"}
        return start_decoder(self, memory)

    def step(self, prev: Tensor, state: State) -> tuple[StepOutput, State]:
        n = prev.size(0)
        hypotheses_per_sentence(n, state["src_mask"])  # N = B * w rows
        pos, rows = state["pos"], state[CACHE_ROWS]  # [N]
        x = self.dropout(self.tgt_embed(prev) + self.positions(pos))[:, None, :]  # [N,1,D]
        new_state: State = {
            **source_state(state),
            "pos": pos + 1,
            CACHE_ROWS: torch.arange(n, device=prev.device),
        }
        layers = range(len(self.decoder))
        caches = [state[f"cache_{kv}{i}"] for i in layers for kv in "kv"]
        sources = [state[f"src_{kv}{i}"] for i in layers for kv in "kv"]
        keys_mask = state["src_keys_mask"]  # [B,S']
        lengths = state.get(CACHE_LENGTHS)  # [N], in a ragged state
        compiled = self._compiled is not None
        chunk = KEY_CHUNK if compiled else key_chunk(caches[0])
        log_probs = None  # the logits' log-softmax, where the step has made it
        if lengths is None and chunk == 1 and not compiled:  # every row fills the whole cache

            def extend(cache: Tensor, new: Tensor) -> Tensor:
                return extend_cache(cache, rows, new, 2)

            logits, weights, caches = self.decode_layers(x, caches, sources, keys_mask, extend)
        else:
            # Each hypothesis writes at its own position (its `pos`: what it has filled), in a
            # cache of whole chunks on CPU in bf16/fp16: the attention products keep their shapes
            # for KEY_CHUNK steps (oneDNN makes and keeps ~0.7 MB of kernels per shape).
            lengths = pos if lengths is None else lengths
            shortest, longest, first = torch.stack([*lengths.aminmax(), rows.min()]).tolist()
            size = cache_size(longest, chunk)  # the cache after this step
            if shortest < longest:
                new_state[CACHE_LENGTHS] = lengths + 1
            if compiled:
                if torch.is_inference_mode_enabled() and not keys_mask.is_inference():
                    keys_mask = keys_mask.clone()  # one kind of tensor: one compiled graph
                caches = [fit_cache(c, size, 2) for c in caches]  # dynamic shapes: no guards
                logits, weights, caches = self._call(  # type: ignore[misc]
                    compiled_layers, x, caches, sources, keys_mask, rows, lengths
                )
                log_probs = logits  # what `compiled_layers` returns
            else:
                # hypotheses that joined with an empty cache have no row of it yet (`join_states`)
                empty = (rows == NO_ROW).nonzero().flatten() if first == NO_ROW else None
                positions = torch.arange(size, device=prev.device)
                if shortest < longest:
                    past = (positions <= lengths[:, None])[:, None, None, :]  # [N,1,1,t']
                else:  # every row fills the same positions: one write for all, one mask
                    lengths, past = None, (positions <= longest)[None, None, None, :]

                def extend(cache: Tensor, new: Tensor) -> Tensor:
                    return extend_ragged_cache(cache, rows, new, lengths, size, 2, longest, empty)

                logits, weights, caches = self.decode_layers(
                    x, caches, sources, keys_mask, extend, past
                )
        for i in layers:
            new_state[f"cache_k{i}"], new_state[f"cache_v{i}"] = caches[2 * i], caches[2 * i + 1]
        s = state["src_mask"].size(1)  # the source positions (without the keys' padding)
        return StepOutput(logits, weights[:, :, :s], log_probs), new_state  # last layer's

    def decode_layers(
        self,
        x: Tensor,
        caches: list[Tensor],
        sources: list[Tensor],
        keys_mask: Tensor,
        extend: Callable[[Tensor, Tensor], Tensor],
        self_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """The decoder layers and the output projection for one position x[N,1,D]: the
        caches and source keys/values of each layer in turn (k, v), the source keys' mask
        [B,S'], `extend` and `self_mask` as `DecoderLayer.step` takes them -> logits [N,V],
        the last layer's cross-attention weights [N,H,S'] and the extended caches."""
        mask = keys_mask[:, None, None, :]  # [B,1,1,S']
        extended: list[Tensor] = []
        for i, layer in enumerate(self.decoder):
            ck, cv, k, v = caches[2 * i], caches[2 * i + 1], sources[2 * i], sources[2 * i + 1]
            x, ck, cv, weights = layer.step(x, ck, cv, extend, k, v, mask, self_mask)
            extended += [ck, cv]
        return self.output(self.dec_norm(x[:, 0])), weights, extended

    def join(self, a: State, b: State) -> State:
        # a cache's size says nothing of what is filled (it may grow by chunks): `pos` does
        a, b = ({CACHE_LENGTHS: s["pos"], **s} for s in (a, b))
        lengths, keys = {"src_mask": 1, "src_keys_mask": 1}, ["src_keys_mask"]
        for i in range(len(self.decoder)):
            lengths.update({f"src_k{i}": 2, f"src_v{i}": 2, f"cache_k{i}": 2, f"cache_v{i}": 2})
            keys += [f"src_k{i}", f"src_v{i}"]
        return join_states(a, b, lengths, chunked=tuple(keys), chunk=key_chunk(a["src_k0"]))

    def forward(
        self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, src_lengths: Tensor | None = None
    ) -> Tensor:
        memory = self.encode(src, src_mask)["memory"]
        mask = src_mask[:, None, None, :]
        positions = torch.arange(tgt_in.size(1), device=tgt_in.device)
        x = self._embed(self.tgt_embed, tgt_in, positions)  # [B,T,D]
        for layer in self.decoder:
            k, v = layer.cross_attn.memory_kv(memory)  # [B,H,S,Dh]
            x = layer(x, k, v, mask)
        return self.output(self.dec_norm(x))  # [B,T,V]
