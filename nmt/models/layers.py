"""Pieces shared by several architectures: embeddings, positions, RNN encoder, attention."""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from nmt.cpu import cpu_has_bf16, cpu_has_vnni
from nmt.models.base import WeightCache
from nmt.special import PAD_ID


class Embedding(nn.Module):
    """Token embedding, optionally scaled by sqrt(D) (Transformer convention)."""

    def __init__(self, vocab_size: int, dim: int, scale: bool = False) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab_size, dim, padding_idx=PAD_ID)
        nn.init.normal_(self.table.weight, mean=0.0, std=dim**-0.5)
        with torch.no_grad():
            self.table.weight[PAD_ID].zero_()
        self.scale = math.sqrt(dim) if scale else 1.0

    @property
    def weight(self) -> nn.Parameter:
        return self.table.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.table(ids) * self.scale  # [..., D]


class Dropout(nn.Module):
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p).

    On CUDA this is `F.dropout`. On CPU the keep mask is drawn as 16 random bits per element
    (one int64 draw gives four), with p quantised to a multiple of 1/65536 and the scale
    matched to it: torch's CPU dropout draws one Bernoulli variate per element, which made it
    2x slower (forward+backward of a [100,15,1024] bf16 tensor: 11.7 ms vs 5.8 ms) and 10%
    of a bf16 transformer training step. Randomness comes from torch's default generator, so
    seeding and exact resume work as with `nn.Dropout`.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        n = x.numel()
        # 16-bit values below -32768 + dropped are dropped; at least one value of 65536 is kept
        dropped = min(round(self.p * 65536), 65535)
        bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
        keep = bits.view(torch.int16)[:n].view(x.shape) >= dropped - 32768
        return (x * keep).mul_(65536 / (65536 - dropped))  # one rounding, as F.dropout

    def extra_repr(self) -> str:
        return f"p={self.p}"


PACK_ROWS = 256  # the row count oneDNN lays a packed weight out for (see PackedInference)
INT8 = "int8"  # the precision name of `int8_linears`, and their weight cache's key
INT8_WIDE = "int8-onednn"  # the weight cache's key of a wide map's oneDNN int8 weight
WIDE = 8  # an int8 map at least this many times wider than its input: `onednn_int8`
WIDE_ROWS = 32  # ... computed on at least this many rows

_int8 = threading.local()  # per thread, as autocast is: decoding workers are threads


@contextlib.contextmanager
def int8_linears() -> Iterator[None]:
    """In this thread, the linear maps of a model (`PackedInference`) compute on int8 weights:
    each output row of a weight quantized symmetrically to 8 bits with its own scale
    (per-channel), the input quantized to 8 bits at every call from its own range (dynamic
    quantization), accumulated in int32 and returned in fp32, by PyTorch's quantized
    `linear_dynamic` (fbgemm: VNNI on AVX-512 CPUs, AVX2 elsewhere), or for wide maps on VNNI
    CPUs by oneDNN from the same integers (`onednn_int8`). What is not a linear map
    (attention scores, softmax, norms, recurrent cells) stays in fp32. Decoding only:
    `nmt.device.autocast(device, "int8")` enters it. The input keeps 7 bits of range
    (`reduce_range`, as torch's own dynamic `Linear` does): AVX2's 8-bit products can overflow
    otherwise, and so every CPU computes the same integers. The input's scale is one for the
    whole call, so a row's result depends on the other rows' range: a sentence's translation
    may change with the batch it is decoded in (fbgemm has no per-row scales)."""
    before = getattr(_int8, "on", False)
    _int8.on = True
    try:
        yield
    finally:
        _int8.on = before


def packed_dtype(x: Tensor) -> torch.dtype | str | None:
    """How a linear map of x runs: `INT8` inside `int8_linears` (CPU inference), else the dtype
    in which it can run on a packed weight: CPU inference (no autograd) in fp32, or in bf16
    (autocast's dtype or x's) on CPUs with native bf16. None elsewhere (training, CUDA, no
    oneDNN, code `torch.compile` traces: inductor packs weights itself), where `F.linear`
    runs as usual."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    if getattr(_int8, "on", False):
        return INT8
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return None
    cast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if cast else x.dtype
    if dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_bf16()):
        return dtype
    return None


def quantized_weight(weight: Tensor) -> Tensor:
    """`weight` [out, in] quantized per output row (symmetric, torch's per-channel observer, as
    `torch.ao.quantization.per_channel_dynamic_qconfig` does): a qint8 tensor."""
    from torch.ao.quantization.observer import PerChannelMinMaxObserver

    w = weight.detach().float()
    observer = PerChannelMinMaxObserver(
        ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric
    )
    observer(w)
    scales, zero_points = observer.calculate_qparams()
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated (2.13)
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)


def int8_weight(weight: Tensor, bias: Tensor | None) -> object:
    """`weight` quantized (`quantized_weight`) and packed with `bias` for
    `torch.ops.quantized.linear_dynamic`."""
    b = None if bias is None else bias.detach().float()
    return torch.ops.quantized.linear_prepack(quantized_weight(weight), b)


def onednn_int8(weight: Tensor, rows: int) -> bool:
    """Whether an int8 map of `weight` [out, in] over `rows` rows runs on oneDNN's u8s8 kernel
    (`onednn_linear`) rather than fbgemm's: on CPUs with VNNI, for maps at least WIDE times
    wider than their input (a vocabulary projection) over at least WIDE_ROWS rows. Measured
    on 2 Zen 4 cores, 1 thread, the [rows,256] x [256,8000] projection: 5.5 ms with fbgemm
    and 3.8 with oneDNN at 320 rows (a beam-5 step of 64 sentences), 1.12 and 0.85 ms at 80,
    0.51 and 0.45 at 40, equal at 20, 78 and 91 µs at 5; for the transformer's other maps
    (out <= 4 x in) fbgemm was as fast or faster (256x256 at 80 rows: 51 vs 75 µs)."""
    out, inputs = weight.shape
    return rows >= WIDE_ROWS and out >= WIDE * inputs and cpu_has_vnni()


def onednn_weight(weight: Tensor, bias: Tensor | None) -> tuple:
    """`weight` quantized as for fbgemm (`quantized_weight`: the same integers and scales),
    packed for oneDNN's `qlinear_pointwise`, with its scales, zero points and `bias`."""
    q = quantized_weight(weight)
    packed = torch.ops.onednn.qlinear_prepack(q.int_repr(), None)
    scales = q.q_per_channel_scales().float()
    zero_points = q.q_per_channel_zero_points()
    return packed, scales, zero_points, None if bias is None else bias.detach().float()


def onednn_linear(x: Tensor, entry: tuple, relu: bool) -> Tensor:
    """x[rows, in] (fp32) times an `onednn_weight` entry: x quantized to 8 bits as
    `linear_dynamic` quantizes it (its own range, 7 bits kept: `reduce_range`), so that the
    int32 products are fbgemm's; scaled to fp32 in one rounding of another order (the
    results differ from fbgemm's in the last bits of some values)."""
    packed, scales, zero_points, bias = entry
    qx = torch.quantize_per_tensor_dynamic(x, torch.quint8, True)
    post = "relu" if relu else "none"
    return torch.ops.onednn.qlinear_pointwise(
        qx.int_repr(),
        qx.q_scale(),
        qx.q_zero_point(),
        packed,
        scales,
        zero_points,
        bias,
        1.0,
        0,
        torch.float32,
        post,
        [],
        "",
    )


class PackedInference(WeightCache):
    """Linear maps that, inside `fixed_weights(model)`, run oneDNN's inner product on a
    weight reordered once into its blocked layout, instead of `F.linear`, which lays the
    weight out again at every call. Outside that scope, or where `packed_dtype` says no,
    they are `F.linear`. Inside `int8_linears` they run on int8 weights, quantized once per
    scope (or at every call outside one).

    Measured on the 2-core Zen 4 machine (2 threads): the [320,256] x [256,8000] output
    projection of a beam-5 step took 9.5 ms with `F.linear` and 6.3 ms packed in fp32 (3.5 vs
    3.2 ms in bf16); beam-5 decoding of the Multi30k transformer went from 89 to 103
    sentences/s in fp32 and from 127 to 147 in bf16. bf16 results are identical to autocast's
    `F.linear`; fp32 results differ in rounding only (summation order).
    """

    def packed_linear(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool = False
    ) -> Tensor:
        """x W^T + b, then ReLU when `relu` (on a packed weight, fused into the product: one
        pass less over the [320,1024] FFN activations of a beam-5 step)."""
        cache = self.weight_cache  # read once: decoding threads share it (see decode_batches)
        dtype = packed_dtype(x)
        if dtype == INT8:
            flat = x.float().reshape(-1, x.size(-1))
            wide = onednn_int8(weight, flat.size(0))
            key, make = (INT8_WIDE, onednn_weight) if wide else (INT8, int8_weight)
            if cache is None:
                packed = make(weight, bias)
            else:  # two threads may both quantize; one is kept
                packed = cache.get(key)
                if packed is None:
                    packed = cache.setdefault(key, make(weight, bias))
            if wide:
                y = onednn_linear(flat, packed, relu)
                return y.view(*x.shape[:-1], y.size(-1))
            y = torch.ops.quantized.linear_dynamic(flat, packed, True)
            y = y.view(*x.shape[:-1], y.size(-1))
            return y.relu_() if relu else y  # y is new: ReLU in place
        if cache is None:
            dtype = None
        if dtype is not None and dtype not in cache:  # two threads may both pack; one is kept
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), PACK_ROWS)
                entry = (packed, None if bias is None else bias.to(dtype))
            except (AttributeError, RuntimeError):  # a torch build without this op
                entry = None
            cache.setdefault(dtype, entry)
        if dtype is None or cache[dtype] is None:
            y = F.linear(x, weight, bias)
            return F.relu(y) if relu else y
        packed, packed_bias = cache[dtype]
        post = "relu" if relu else "none"
        return torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, packed_bias, post, [], "")


class Linear(PackedInference, nn.Linear):
    """`nn.Linear` (same parameters and state dict) with packed CPU inference."""

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        return self.packed_linear(x, self.weight, self.bias, relu)


class OutputProjection(PackedInference, nn.Module):
    """Hidden state -> vocabulary logits; shares the weight of `tie_to` when given."""

    def __init__(self, dim: int, vocab_size: int, tie_to: Embedding | None = None) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        if tie_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, dim))
            nn.init.normal_(self.weight, mean=0.0, std=dim**-0.5)
        else:
            self.weight = tie_to.table.weight

    def forward(self, hidden: Tensor) -> Tensor:
        return self.packed_linear(hidden, self.weight, self.bias)  # [..., V]


def sinusoidal(positions: Tensor, dim: int) -> Tensor:
    """positions[...] -> [..., D] sin/cos encodings (Vaswani et al. 2017), for any position."""
    half = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
    angles = positions.float()[..., None] * torch.exp(half * (-math.log(10000.0) / dim))
    out = torch.zeros(*positions.shape, dim, device=positions.device)
    out[..., 0::2] = torch.sin(angles)
    out[..., 1::2] = torch.cos(angles)[..., : dim // 2]
    return out


def sinusoidal_halves(n: int, dim: int) -> Tensor:
    """[n, D] encodings of positions 0..n-1 laid out as Marian lays them: sines in the first
    half of the vector, cosines in the second (`sinusoidal` interleaves them), same
    frequencies. Computed as Hugging Face's `MarianSinusoidalPositionalEmbedding.create_weight`
    computes them (float64 numpy, the same expressions, rounded to fp32 once), so a Marian
    export recomputing its table gets these values bit for bit (tests/test_export.py)."""
    inverse = np.array([np.power(10000, 2 * (j // 2) / dim) for j in range(dim)])  # [D]
    angles = np.arange(n)[:, None] / inverse  # [n, D], float64 division as Marian's
    out = torch.empty(n, dim, dtype=torch.float32)
    sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    out[:, :sentinel] = torch.from_numpy(np.sin(angles[:, 0::2]))
    out[:, sentinel:] = torch.from_numpy(np.cos(angles[:, 1::2]))
    return out


class Positions(nn.Module):
    """Positional encodings by position index: sinusoidal (fixed, unbounded, sin/cos
    interleaved), learned (`max_len` entries), or sinusoidal_marian (Marian's fixed table of
    `max_len` entries, sines then cosines: `sinusoidal_halves`). Past a table's last entry,
    positions reuse it."""

    def __init__(self, kind: str, max_len: int, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.table = (
            nn.Parameter(torch.randn(max_len, dim) * dim**-0.5) if kind == "learned" else None
        )
        # A buffer outside the state dict: checkpoints are the same for every kind but learned.
        halves = sinusoidal_halves(max_len, dim) if kind == "sinusoidal_marian" else None
        self.register_buffer("halves", halves, persistent=False)
        self._sinusoids: Tensor | None = None  # CPU: sinusoidal(0..n-1), grown on demand

    def forward(self, positions: Tensor) -> Tensor:
        if self.table is not None:
            return self.table[positions.clamp(max=self.table.size(0) - 1)]
        if self.halves is not None:
            return self.halves[positions.clamp(max=self.halves.size(0) - 1)]
        if (
            positions.device.type != "cpu"
            or positions.numel() == 0
            or torch.is_grad_enabled()  # training: no host sync, no graph break when compiled
            or torch.compiler.is_compiling()
        ):
            return sinusoidal(positions, self.dim)
        # Decoding on CPU reads a table: the formula's eight small ops took 0.12 ms of a 26 ms
        # beam-5 step, a row lookup 5 us. Same values (elementwise ops on the same inputs).
        n = int(positions.max()) + 1
        table = self._sinusoids  # read once: decoding threads share it
        if table is None or table.size(0) < n:
            size = max(n, 2 * (0 if table is None else table.size(0)), 64)
            table = self._sinusoids = sinusoidal(torch.arange(size), self.dim)
        return table.index_select(0, positions.flatten()).view(*positions.shape, self.dim)


def _lstm_needs_fp32() -> bool:
    """CPU bf16 autocast on a CPU without native bf16 units."""
    return (
        torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and not cpu_has_bf16()
    )


def explicit_rnn_dtype(
    device_type: str, autocast_enabled: bool, autocast_dtype: torch.dtype
) -> torch.dtype | None:
    """The dtype a GRU/LSTM must be run in by hand, outside autocast, or None where autocast
    (or no autocast) already runs it right.

    CUDA autocast's rule for cuDNN RNNs casts input and weights to fp16 whatever the autocast
    dtype (aten/src/ATen/cudnn/AutocastRNN.cpp), so under bf16 autocast the RNN would run in
    fp16, without loss scaling. There the RNN runs with autocast off, in autocast's dtype
    (bf16, or fp16 with the scaler). CPU autocast runs oneDNN's RNN in its own dtype: None."""
    if device_type != "cuda" or not autocast_enabled:
        return None
    return autocast_dtype


class RNN(WeightCache, nn.Module):
    """A GRU or LSTM whose hidden state is exchanged batch-first: [B, L*dirs, H].

    Under CUDA autocast it runs in autocast's dtype by hand (`explicit_rnn_dtype`), on weights
    cast once per `fixed_weights` scope: once per decoding, once per forward of a model that
    calls it at every target position (`nmt.models.rnn_attention`). `nn.RNNBase` flattens its
    weights into cuDNN's layout itself whenever the module moves (`_apply`), so once after
    `.to(device)`, not at every call."""

    def __init__(
        self,
        cell: str,
        input_dim: int,
        hidden: int,
        layers: int,
        bidirectional: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        rnn_cls = nn.LSTM if cell == "lstm" else nn.GRU
        self.is_lstm = cell == "lstm"
        self.rnn = rnn_cls(
            input_dim,
            hidden,
            num_layers=layers,
            bidirectional=bidirectional,
            dropout=dropout if layers > 1 else 0.0,
            batch_first=True,
        )

    def weights_in(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """The RNN's parameters cast to `dtype` (differentiable casts of the fp32 weights), once
        per `fixed_weights` scope, else at every call."""
        cache = self.weight_cache
        if cache is not None and dtype in cache:
            return cache[dtype]
        weights = {name: p.to(dtype) for name, p in self.rnn.named_parameters()}
        return weights if cache is None else cache.setdefault(dtype, weights)

    def forward(
        self, x: Tensor | PackedSequence, hidden: Tensor | None = None, cell: Tensor | None = None
    ) -> tuple[Tensor | PackedSequence, Tensor, Tensor | None]:
        """x[B,T,I], hidden/cell[B,L,H] -> outputs[B,T,H], hidden[B,L,H], cell[B,L,H] | None."""
        h0 = None if hidden is None else hidden.transpose(0, 1).contiguous()  # [L,B,H]
        c0 = None if cell is None else cell.transpose(0, 1).contiguous()
        device = x.data.device.type  # a PackedSequence's data, or the tensor itself
        dtype = explicit_rnn_dtype(
            device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        )
        if dtype is not None:
            with torch.autocast(device, enabled=False):
                state = None if h0 is None else h0.to(dtype)
                if self.is_lstm:
                    state = None if h0 is None else (h0.to(dtype), c0.to(dtype))
                out, hc = functional_call(self.rnn, self.weights_in(dtype), (x.to(dtype), state))
        elif self.is_lstm and _lstm_needs_fp32():
            # oneDNN has no bf16 LSTM primitive on CPUs without native bf16 ("could not create
            # a primitive descriptor"): run the cell in fp32 there.
            with torch.autocast("cpu", enabled=False):
                state = None if h0 is None else (h0.float(), c0.float())
                out, hc = self.rnn(x.float(), state)
        elif self.is_lstm:
            out, hc = self.rnn(x, None if h0 is None else (h0, c0))
        else:
            out, hc = self.rnn(x, h0)
        if self.is_lstm:
            h, c = hc
            return out, h.transpose(0, 1), c.transpose(0, 1)
        return out, hc.transpose(0, 1), None


class RNNEncoder(nn.Module):
    """Embedding + (bi)RNN over the source, padding-aware through packed sequences."""

    def __init__(
        self,
        vocab_size: int,
        emb_dim: int,
        hidden: int,
        layers: int,
        cell: str,
        bidirectional: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        self.embed = Embedding(vocab_size, emb_dim)
        self.dropout = Dropout(dropout)
        self.rnn = RNN(cell, emb_dim, hidden, layers, bidirectional, dropout)
        self.dirs = 2 if bidirectional else 1
        self.layers = layers
        self.hidden = hidden
        self.out_dim = hidden * self.dirs

    def forward(
        self, src: Tensor, src_mask: Tensor, src_lengths: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """src[B,S], src_mask[B,S] -> outputs[B,S,dirs*H] (zero at pads), final[B,dirs*H].

        `final` is the top layer's last state in each direction (forward at the last real
        token, backward at the first), concatenated. Packing needs the lengths on the host:
        `src_lengths` [B] (CPU) when the caller has them, else read from the mask (on CUDA, a
        wait for the device).
        """
        x = self.dropout(self.embed(src))  # [B,S,E]
        lengths = src_mask.sum(1).cpu() if src_lengths is None else src_lengths
        # Sorted longest first here, as pack_padded_sequence sorts them itself (enforce_sorted
        # False: the same torch.sort, the same order), but with the order sent to the device
        # ahead (pinned, non-blocking): its own copies it there and back, two waits for the
        # GPU at every step. The outputs and states are put back in the batch's order.
        lengths, order = torch.sort(torch.as_tensor(lengths, dtype=torch.int64), descending=True)
        if x.is_cuda:
            order = order.pin_memory().to(x.device, non_blocking=True)
        restore = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=order.device)
        )
        packed = pack_padded_sequence(
            x.index_select(0, order), lengths, batch_first=True, enforce_sorted=True
        )
        out, hidden, _ = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
        out = out.index_select(0, restore)  # [B,S,dirs*H]
        hidden = hidden.index_select(0, restore)  # [B,L*dirs,H]
        top = hidden[:, -self.dirs :, :]  # [B,dirs,H] last layer, each direction
        final = top.reshape(top.size(0), self.out_dim)  # [B,dirs*H]
        return self.dropout(out), final


def softmax(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Softmax over the last dimension (computed in `dtype` when given), for attention rows.

    On CPU, torch's softmax over the last dimension is vectorized along a row only when the row
    holds at least a vector of values (16 fp32 with AVX-512); shorter rows, as attention over
    the few positions of a decoding step or a short source, take a scalar path 4-5x slower:
    [1280, 12] fp32 took 267 us, against 51 us as a softmax over the first dimension of the
    transposed rows, which is vectorized across rows (1 thread; 1280 rows of 20: 55 vs 70 us,
    so only short rows take that way). Same values up to rounding (< 1.2e-7 apart)."""
    size = x.size(-1)
    if torch.compiler.is_compiling() or x.device.type != "cpu" or size >= 16 or x.numel() == 0:
        return torch.softmax(x, -1, dtype=dtype)
    across = torch.softmax(x.reshape(-1, size).t(), 0, dtype=dtype)  # [S, rows]
    return across.t().contiguous().view(x.shape)


NEG_INF = -1e9  # safe in fp16/bf16 once scores are cast to fp32 before the softmax


class RecurrentAttention(nn.Module):
    """Attention of one decoder query over encoder states.

    additive (Bahdanau): e_i = vᵀ tanh(W q + U h_i); general (Luong): e_i = qᵀ W_a h_i;
    dot (Luong): e_i = qᵀ h_i. The query-independent part (U h_i or W_a h_i) is computed once
    per sentence by `keys`, not at every step.
    """

    def __init__(self, kind: str, query_dim: int, memory_dim: int, attn_dim: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "additive":
            self.key_proj = Linear(memory_dim, attn_dim, bias=False)  # U
            self.query_proj = Linear(query_dim, attn_dim, bias=True)  # W
            self.v = Linear(attn_dim, 1, bias=False)
        elif kind == "general":
            self.key_proj = Linear(memory_dim, query_dim, bias=False)  # W_a
        elif kind != "dot":
            raise ValueError(f"unknown attention {kind!r}")

    def keys(self, memory: Tensor) -> Tensor:
        """memory[B,S,M] -> keys[B,S,A] (A = attn_dim for additive, query dim otherwise)."""
        return memory if self.kind == "dot" else self.key_proj(memory)

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """query[B,Tq,Q], keys[B,S,A] -> scores[B,Tq,S]."""
        if self.kind == "additive":
            q = self.query_proj(query)  # [B,Tq,A]
            return self.v(torch.tanh(q[:, :, None, :] + keys[:, None, :, :])).squeeze(-1)
        return query @ keys.transpose(1, 2)  # [B,Tq,Q] @ [B,Q,S] -> [B,Tq,S]

    def forward(
        self, query: Tensor, keys: Tensor, memory: Tensor, src_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """query[B,Tq,Q] -> context[B,Tq,M], weights[B,Tq,S] (zero at pads, rows sum to 1)."""
        e = self.scores(query, keys).float()
        e = e.masked_fill(~src_mask[:, None, :], NEG_INF)
        weights = softmax(e)
        context = weights.to(memory.dtype) @ memory  # [B,Tq,S] @ [B,S,M] -> [B,Tq,M]
        return context, weights
