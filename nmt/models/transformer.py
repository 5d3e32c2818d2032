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

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nmt.models.base import (
    CACHE_LENGTHS,
    CACHE_ROWS,
    NO_ROW,
    State,
    StepOutput,
    cache_size,
    extend_cache,
    extend_ragged_cache,
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
        return self.out(y), weights.transpose(1, 2).reshape(n, self.heads, -1)


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
        rows: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor,
        ragged: tuple[Tensor | None, int, Tensor, int, Tensor | None] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One position x[N,1,D] of N hypotheses, which continue the rows `rows` [N] of the
        cache [M,H,t,Dh], against their sentences' source k/v[B,H,S,Dh] -> y, cache_k' and
        cache_v' [N,H,t+1,Dh], and the cross-attention weights [N,H,S]. With `ragged` =
        (filled positions [N] or None when all fill the same, the new cache size t',
        self-attention mask [N or 1,1,1,t'], the most filled), each new position is written
        at its hypothesis' length."""
        q, k_new, v_new = self.self_attn.project(self.res_self.inner(x))  # [N,H,1,Dh]
        if ragged is None:
            cache_k = extend_cache(cache_k, rows, k_new, 2)  # [N,H,t+1,Dh]
            cache_v = extend_cache(cache_v, rows, v_new, 2)
            y, _ = attend_step(q, cache_k, cache_v)  # all cached positions are past
        else:
            lengths, size, self_mask, longest, empty = ragged
            cache_k = extend_ragged_cache(cache_k, rows, k_new, lengths, size, 2, longest, empty)
            cache_v = extend_ragged_cache(cache_v, rows, v_new, lengths, size, 2, longest, empty)
            y, _ = attend_step(q, cache_k, cache_v, self_mask)  # the filled positions
        x = self.res_self.outer(x, self.self_attn.out(merge_heads(y)))
        y, weights = self.cross_attn.step(self.res_cross.inner(x), k, v, mask)
        x = self.res_cross.outer(x, y)
        x = self.res_ffn.outer(x, self.ffn(self.res_ffn.inner(x)))
        return x, cache_k, cache_v, weights


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

    def _embed(self, embed: Embedding, ids: Tensor, positions: Tensor) -> Tensor:
        return self.dropout(embed(ids) + self.positions(positions))  # [B,T,D]

    # -- contract --------------------------------------------------------------------------
    def encode(self, src: Tensor, src_mask: Tensor, src_lengths: Tensor | None = None) -> State:
        positions = torch.arange(src.size(1), device=src.device)
        x = self._embed(self.src_embed, src, positions)  # [B,S,D]
        mask = src_mask[:, None, None, :]  # [B,1,1,S]
        for layer in self.encoder:
            x = layer(x, mask)
        return {"memory": self.enc_norm(x), "src_mask": src_mask}

    def init_state(self, memory: State) -> State:
        mem = memory["memory"]  # [B,S,D]
        b = mem.size(0)
        dh = self.d_model // self.heads
        state: State = {
            "src_mask": memory["src_mask"],
            "pos": mem.new_zeros(b, dtype=torch.long),
            CACHE_ROWS: torch.arange(b, device=mem.device),
        }
        kv = [layer.cross_attn.memory_kv(mem) for layer in self.decoder]  # once per sentence
        # the source keys in whole chunks where the caches grow by chunks (masked, `key_chunk`)
        keys = round_up(mem.size(1), key_chunk(kv[0][0]))
        state["src_keys_mask"] = pad_end(memory["src_mask"], 1, keys)  # [B,S'] True: a token
        for i, (k, v) in enumerate(kv):
            k, v = pad_end(k.contiguous(), 2, keys), pad_end(v.contiguous(), 2, keys)
            state[f"src_k{i}"], state[f"src_v{i}"] = k, v
            state[f"cache_k{i}"] = k.new_zeros(b, self.heads, 0, dh)  # empty cache [B,H,0,Dh]
            state[f"cache_v{i}"] = k.new_zeros(b, self.heads, 0, dh)
        return state

    def step(self, prev: Tensor, state: State) -> tuple[StepOutput, State]:
        n = prev.size(0)
        hypotheses_per_sentence(n, state["src_mask"])  # N = B * w rows
        pos, rows = state["pos"], state[CACHE_ROWS]  # [N]
        x = self.dropout(self.tgt_embed(prev) + self.positions(pos))[:, None, :]  # [N,1,D]
        mask = state["src_keys_mask"][:, None, None, :]  # [B,1,1,S']
        new_state: State = {
            **source_state(state),
            "pos": pos + 1,
            CACHE_ROWS: torch.arange(n, device=prev.device),
        }
        ragged = None
        lengths = state.get(CACHE_LENGTHS)  # [N], in a ragged state
        chunk = key_chunk(state["cache_k0"])
        if lengths is not None or chunk > 1:
            # Each hypothesis writes at its own position (its `pos`: what it has filled), in a
            # cache of whole chunks on CPU in bf16/fp16: the attention products keep their shapes
            # for KEY_CHUNK steps (oneDNN makes and keeps ~0.7 MB of kernels per shape).
            lengths = pos if lengths is None else lengths
            shortest, longest, first = torch.stack([*lengths.aminmax(), rows.min()]).tolist()
            # hypotheses that joined with an empty cache have no row of it yet (`join_states`)
            empty = (rows == NO_ROW).nonzero().flatten() if first == NO_ROW else None
            size = cache_size(longest, chunk)  # the cache after this step
            positions = torch.arange(size, device=prev.device)
            if shortest < longest:
                past = (positions <= lengths[:, None])[:, None, None, :]  # [N,1,1,t']
                new_state[CACHE_LENGTHS] = lengths + 1
            else:  # every row fills the same positions: one write for all, one mask
                lengths, past = None, (positions <= longest)[None, None, None, :]
            ragged = (lengths, size, past, longest, empty)
        for i, layer in enumerate(self.decoder):
            ck, cv = state[f"cache_k{i}"], state[f"cache_v{i}"]
            k, v = state[f"src_k{i}"], state[f"src_v{i}"]
            x, ck, cv, weights = layer.step(x, ck, cv, rows, k, v, mask, ragged)
            new_state.update({f"cache_k{i}": ck, f"cache_v{i}": cv})
        logits = self.output(self.dec_norm(x[:, 0]))  # [N,V]
        s = state["src_mask"].size(1)  # the source positions (without the keys' padding)
        attention = weights[:, :, :s].mean(1)  # last layer, averaged over heads [N,S]
        return StepOutput(logits, attention), new_state

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
