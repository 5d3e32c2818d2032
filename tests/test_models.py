"""Contract and property tests, parametrized over every registered architecture variant."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io

import pytest
import torch

from nmt.models.base import (
    CACHE_LENGTHS,
    CACHE_PREFIX,
    KEY_CHUNK,
    NO_ROW,
    SOURCE_PREFIX,
    StepOutput,
    Vocab,
    count_parameters,
    extend_cache,
    extend_ragged_cache,
    fixed_weights,
    reorder_state,
    step_log_probs,
)
from nmt.models.configs import CONFIGS, RNNAttentionConfig, Seq2SeqConfig, TransformerConfig
from nmt.models.layers import (
    Dropout,
    Linear,
    Positions,
    packed_dtype,
    sinusoidal,
    softmax,
)
from nmt.models.registry import build_model
from nmt.special import BOS_ID, PAD_ID

V = 37
VOCAB = Vocab(V, V, shared=True)

VARIANTS = {
    "seq2seq-gru": ("seq2seq", Seq2SeqConfig(emb_dim=16, hidden=24, enc_layers=2, dec_layers=2)),
    "seq2seq-lstm-uni": (
        "seq2seq",
        Seq2SeqConfig(
            cell="lstm", emb_dim=16, hidden=24, bidirectional=False, tie_embeddings=False
        ),
    ),
    "rnn_attention-additive": (
        "rnn_attention",
        RNNAttentionConfig(emb_dim=16, enc_hidden=12, dec_hidden=20, attn_dim=10, dec_layers=2),
    ),
    "rnn_attention-general-feed-lstm": (
        "rnn_attention",
        RNNAttentionConfig(
            cell="lstm",
            emb_dim=16,
            enc_hidden=12,
            dec_hidden=20,
            attention="general",
            input_feed=True,
        ),
    ),
    "rnn_attention-dot": (
        "rnn_attention",
        RNNAttentionConfig(emb_dim=16, enc_hidden=10, dec_hidden=20, attention="dot"),
    ),
    "transformer-pre": (
        "transformer",
        TransformerConfig(d_model=32, heads=4, enc_layers=2, dec_layers=2, ffn_dim=48),
    ),
    "transformer-post-learned-gelu": (
        "transformer",
        TransformerConfig(
            d_model=32,
            heads=2,
            enc_layers=1,
            dec_layers=2,
            ffn_dim=40,
            norm="post",
            positions="learned",
            activation="gelu",
            max_positions=64,
        ),
    ),
    "transformer-post-marian": (
        "transformer",
        TransformerConfig(
            d_model=32,
            heads=4,
            enc_layers=2,
            dec_layers=1,
            ffn_dim=48,
            norm="post",
            positions="sinusoidal_marian",
            max_positions=16,  # shorter than some test sequences: later positions reuse the last
        ),
    ),
}
ATTENTION_ARCHS = {"rnn_attention", "transformer"}


def test_every_architecture_has_a_variant():
    assert set(CONFIGS) == {arch for arch, _ in VARIANTS.values()}


def make(name: str, vocab: Vocab = VOCAB) -> torch.nn.Module:
    arch, cfg = VARIANTS[name]
    torch.manual_seed(0)
    return build_model(arch, cfg, vocab).eval()


def batch(lengths_src, lengths_tgt, seed=0):
    """Right-padded random ids (no special ids inside sentences)."""
    g = torch.Generator().manual_seed(seed)
    b, s, t = len(lengths_src), max(lengths_src), max(lengths_tgt)
    src = torch.randint(4, V, (b, s), generator=g)
    tgt = torch.randint(4, V, (b, t), generator=g)
    for i, (ls, lt) in enumerate(zip(lengths_src, lengths_tgt)):
        src[i, ls:] = PAD_ID
        tgt[i, lt:] = PAD_ID
    tgt[:, 0] = BOS_ID
    return src, src != PAD_ID, tgt


def pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, length - x.size(1)), value=PAD_ID)


@pytest.fixture(params=sorted(VARIANTS))
def variant(request) -> str:
    return request.param


def test_forward_shape(variant):
    model = make(variant)
    src, mask, tgt = batch([5, 3, 7], [4, 6, 2])
    assert model(src, mask, tgt).shape == (3, 6, V)


def test_padding_invariance(variant):
    model = make(variant)
    src, mask, tgt = batch([5, 3, 7], [4, 6, 2])
    logits = model(src, mask, tgt)
    src2, tgt2 = pad_to(src, 11), pad_to(tgt, 9)
    logits2 = model(src2, src2 != PAD_ID, tgt2)
    for i, lt in enumerate([4, 6, 2]):
        torch.testing.assert_close(logits2[i, :lt], logits[i, :lt], atol=1e-5, rtol=1e-5)
    # A sentence alone equals the same sentence inside a padded batch.
    alone = model(src[1:2, :3], mask[1:2, :3], tgt[1:2, :6])
    torch.testing.assert_close(alone[0], logits[1, :6], atol=1e-5, rtol=1e-5)


def test_causality(variant):
    model = make(variant)
    src, mask, tgt = batch([6, 4], [7, 7])
    logits = model(src, mask, tgt)
    for t in (0, 3, 5):
        changed = tgt.clone()
        changed[:, t + 1 :] = torch.randint(4, V, changed[:, t + 1 :].shape)
        torch.testing.assert_close(model(src, mask, changed)[:, : t + 1], logits[:, : t + 1])


def test_incremental_decoding_equals_teacher_forcing(variant):
    model = make(variant)
    src, mask, tgt = batch([5, 3, 7], [6, 6, 6])
    full = model(src, mask, tgt)
    state = model.init_state(model.encode(src, mask))
    for t in range(tgt.size(1)):
        out, state = model.step(tgt[:, t], state)
        torch.testing.assert_close(out.logits, full[:, t], atol=1e-5, rtol=1e-5)


def test_state_is_batch_first_and_step_does_not_mutate(variant):
    model = make(variant)
    src, mask, tgt = batch([5, 3], [4, 4])
    state = model.init_state(model.encode(src, mask))
    before = {k: v.clone() for k, v in state.items()}
    model.step(tgt[:, 0], state)
    for k, v in state.items():
        assert v.size(0) == 2, k
        torch.testing.assert_close(v, before[k])


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.inference_mode])
def test_reorder_state_serves_beam_expansion(variant, mode):
    """Hypothesis rows selected by reorder_state (several per sentence, the source side one row
    per sentence) decode as the selected sentences would on their own; with autograd, and in
    inference mode (decoding), where caches take their rows in the copy that extends them."""
    with mode():
        check_reorder_state(make(variant))


def check_reorder_state(model) -> None:
    src, mask, tgt = batch([5, 3, 6], [4, 4, 4])
    state = model.init_state(model.encode(src, mask))
    ref, ref_state = model.step(tgt[:, 0], state)
    ref2, _ = model.step(tgt[:, 1], ref_state)
    sentences = torch.tensor([2, 0])  # sentence 1 has finished; 2 now comes first
    index = sentences.repeat_interleave(3)  # three hypotheses each
    out, out_state = model.step(tgt[:, 0][index], reorder_state(state, index, sentences))
    torch.testing.assert_close(out.logits, ref.logits[index])
    if out.attention is not None:
        torch.testing.assert_close(out.attention, ref.attention[index])
    # A reorder within sentences leaves the source side as it is.
    within = torch.tensor([2, 0, 1, 3, 3, 4])
    reordered = reorder_state(out_state, within)
    out2, _ = model.step(tgt[:, 1][index][within], reordered)
    torch.testing.assert_close(out2.logits, ref2.logits[index][within])
    for k, v in reordered.items():  # caches are left for the step to reorder
        assert (v is out_state[k]) == k.startswith((SOURCE_PREFIX, CACHE_PREFIX)), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_log_probs_are_log_softmax_in_fp32(dtype):
    """The same values as `log_softmax(logits, dtype=float32)` (computed in place on CPU
    without autograd), and through autograd where logits need a gradient."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 50, generator=g) * 4).to(dtype)
    expected = torch.log_softmax(logits, -1, dtype=torch.float32)
    with torch.inference_mode():
        got = step_log_probs(StepOutput(logits.clone(), None))
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    grad = logits.clone().requires_grad_()
    out = step_log_probs(StepOutput(grad, None))
    assert torch.equal(out.detach(), expected) and out.requires_grad
    assert torch.equal(grad.detach(), logits)  # a leaf that needs a gradient is not written over
    given = torch.randn(6, 50, generator=g).to(dtype)  # the model's own log-probs win
    assert torch.equal(step_log_probs(StepOutput(logits, None, given)), given.float())


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.inference_mode])
def test_extend_cache_is_select_then_append(mode):
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([2, 0, 0, 1, 2])
    with mode():
        for t in (0, 1, 4):
            cache = torch.randn(3, 2, t, 5, generator=g)
            new = torch.randn(5, 2, 1, 5, generator=g)
            out = extend_cache(cache, rows, new, 2)
            assert torch.equal(out, torch.cat([cache[rows], new], 2))
            assert out.is_contiguous()


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.inference_mode])
def test_join_decodes_each_sentence_as_it_would_alone(variant, mode):
    """Sentences joined to others half-way through their decoding (`join`: other source
    lengths, other cache lengths) step as they would alone, through steps in which the
    joined caches are ragged, and after the longer-running sentences have left."""
    join_decodes_as_alone(variant, mode, torch.float32)


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.inference_mode])
@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if v.startswith("transformer")))
def test_a_join_in_bf16_decodes_each_sentence_as_it_would_alone(variant, mode):
    """The same in bf16 autocast, where the transformer's keys and caches come in chunks on
    CPU. (Not the RNNs: their bf16 products round differently with the batch's shape, 2e-4
    relative in an attention weight of rnn_attention-additive, bf16's rounding, not the join's.)"""
    join_decodes_as_alone(variant, mode, torch.bfloat16)


def join_decodes_as_alone(variant: str, mode, dtype: torch.dtype) -> None:
    model = make(variant)
    src, mask, tgt = batch([5, 3, 6, 2], [7, 7, 7, 7], seed=1)
    w = 2  # hypotheses per sentence
    low = torch.autocast("cpu", dtype, enabled=dtype != torch.float32)
    with mode(), low:
        # a: sentences 0 and 1, two steps ahead; b: sentences 2 and 3 (longer source), fresh
        state = {}
        for part in ((0, 1), (2, 3)):
            idx = torch.tensor(part)
            s = model.init_state(model.encode(src[idx], mask[idx]))
            state[part] = reorder_state(s, torch.arange(2).repeat_interleave(w))
        for t in range(2):
            _, state[0, 1] = model.step(tgt[:2, t].repeat_interleave(w), state[0, 1])
        joined = model.join(state[0, 1], state[2, 3])
        if dtype != torch.float32:  # the chunked keys this case is for
            assert joined["src_k0"].dtype == dtype and joined["src_k0"].shape[2] == KEY_CHUNK
        for k, v in joined.items():  # caches keep the rows `rows` points into
            assert k.startswith(CACHE_PREFIX) or v.size(0) == (4 if k.startswith("src_") else 8)
        alone = dict(state)
        for t in range(3):
            prev = torch.cat([tgt[:2, t + 2], tgt[2:, t]]).repeat_interleave(w)
            out, joined = model.step(prev, joined)
            for part, at in (((0, 1), t + 2), ((2, 3), t)):
                idx = torch.tensor(part)
                ref, alone[part] = model.step(tgt[idx, at].repeat_interleave(w), alone[part])
                got = slice(0, 2 * w) if part == (0, 1) else slice(2 * w, 4 * w)
                torch.testing.assert_close(out.logits[got], ref.logits, atol=1e-5, rtol=1e-5)
                if out.attention is not None:
                    att = out.attention[got, : ref.attention.size(1)]
                    torch.testing.assert_close(att, ref.attention, atol=1e-5, rtol=1e-5)
                    assert not out.attention[got, ref.attention.size(1) :].any()  # padding
        # sentences 0 and 1 leave: 2 and 3 go on as alone, their caches no longer ragged
        left = reorder_state(joined, torch.arange(2 * w, 4 * w), torch.tensor([2, 3]))
        for t in range(3, 5):
            out, left = model.step(tgt[2:, t].repeat_interleave(w), left)
            ref, alone[2, 3] = model.step(tgt[2:, t].repeat_interleave(w), alone[2, 3])
            torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
        assert CACHE_LENGTHS not in left


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_joined_caches_are_ragged_until_their_lengths_meet(dtype):
    """A transformer's joined state says how many cache positions each hypothesis has filled
    (`len`) while they differ. On CPU in bf16 (oneDNN's attention products, a kernel per shape)
    a cache holds whole chunks of KEY_CHUNK positions, zero past each row's filled ones, and so
    do the source keys; in fp32 (MKL's, no kernels kept) they hold what is filled."""
    model = make("transformer-pre")
    src, mask, tgt = batch([4, 6], [5, 5])
    chunk = KEY_CHUNK if dtype == torch.bfloat16 else 1
    with torch.inference_mode(), torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
        a = model.init_state(model.encode(src[:1], mask[:1]))
        for t in range(3):
            _, a = model.step(tgt[:1, t], a)
        assert a["cache_k0"].dtype == dtype
        assert a["cache_k0"].shape[2] == max(3, chunk) and not a["cache_k0"][:, :, 3:].any()
        b = model.init_state(model.encode(src[1:], mask[1:]))
        assert b["src_k0"].shape[2] == max(6, chunk) and b["src_keys_mask"].sum() == 6
        joined = model.join(a, b)
        assert joined[CACHE_LENGTHS].tolist() == [3, 0]
        # b's hypothesis has nothing filled yet: no row of the cache, which is a's, not copied
        assert joined["rows"].tolist() == [0, NO_ROW]
        assert joined["cache_k0"] is a["cache_k0"]
        _, joined = model.step(tgt[:, 0], joined)
        assert joined[CACHE_LENGTHS].tolist() == [4, 1]
        assert joined["cache_k0"].shape[2] == max(4, chunk)
        assert joined["cache_v1"][1, :, :1].any() and not joined["cache_v1"][1, :, 1:].any()
        one = reorder_state(joined, torch.tensor([1]), torch.tensor([1]))  # the longer leaves
        for t in range(1, 1 + KEY_CHUNK):
            _, one = model.step(tgt[1:, t % 5], one)
        assert CACHE_LENGTHS not in one  # one row: filled as far as the cache says
        assert one["cache_k0"].shape[2] == (2 * KEY_CHUNK if chunk > 1 else 9)  # 9 filled
        assert one["cache_k0"][:, :, 8].any() and not one["cache_k0"][:, :, 9:].any()


def test_a_join_leaves_no_padding_of_sentences_gone(variant):
    """Joined states hold as many source positions as the longest source among the
    sentences they hold: a long sentence that has left leaves no padding behind."""
    model = make(variant)
    src, mask, _ = batch([3, 20, 4], [2, 2, 2])
    with torch.inference_mode():
        states = [
            model.init_state(model.encode(src[i : i + 1, :n], mask[i : i + 1, :n]))
            for i, n in ((0, 3), (1, 20), (2, 4))
        ]
        joined = model.join(states[0], states[1])  # the long one joins...
        short = reorder_state(joined, torch.tensor([0]), torch.tensor([0]))  # ...and leaves
        again = model.join(short, states[2])
        never = model.join(states[0], states[2])  # as if the long one had never come
    for key, value in never.items():
        if key.startswith(SOURCE_PREFIX):
            assert again[key].shape == value.shape, key
            torch.testing.assert_close(again[key], value)


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.inference_mode])
def test_extend_ragged_cache_writes_each_row_at_its_length(mode):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 2, 4, 5, generator=g)
    cache[1, :, 2:] = 0  # row 1 has filled 2 positions, row 2 one
    cache[2, :, 1:] = 0
    rows, lengths = torch.tensor([1, 0, 2]), torch.tensor([2, 4, 1])
    new = torch.randn(3, 2, 1, 5, generator=g)
    with mode():
        out = extend_ragged_cache(cache, rows, new, lengths, 8, 2, 4)  # a chunk of 8
        shorter = extend_ragged_cache(cache, rows[[0, 2]], new[[0, 2]], lengths[[0, 2]], 3, 2, 2)
        aligned = extend_ragged_cache(cache, rows, new, None, 6, 2, 4)  # all have filled 4
        # rows 0 and 2 start empty (NO_ROW, those given as `empty`): zeros, then their entry
        starting = torch.tensor([NO_ROW, 0, NO_ROW])
        fresh = extend_ragged_cache(
            cache, starting, new, torch.tensor([0, 4, 0]), 8, 2, 4, torch.tensor([0, 2])
        )
    expected = torch.cat([cache[rows], torch.zeros(3, 2, 4, 5)], 2)
    for i, at in enumerate(lengths.tolist()):
        expected[i, :, at] = new[i, :, 0]
    assert torch.equal(out, expected)
    assert torch.equal(shorter, expected[[0, 2], :, :3])  # past the longest row: dropped
    assert torch.equal(aligned[:, :, :4], cache[rows]) and torch.equal(aligned[:, :, 4:5], new)
    assert aligned.shape[2] == 6 and not aligned[:, :, 5:].any()
    assert torch.equal(fresh[1], expected[1])
    for i in (0, 2):
        assert torch.equal(fresh[i, :, 0], new[i, :, 0]) and not fresh[i, :, 1:].any()


def test_source_state_is_constant_over_steps(variant):
    """`src_*` state entries depend on the source alone and hold one row per sentence:
    decoding steps carry them unchanged, however many hypotheses each sentence has."""
    model = make(variant)
    src, mask, tgt = batch([5, 3], [4, 4])
    state = model.init_state(model.encode(src, mask))
    source = {k: v.clone() for k, v in state.items() if k.startswith(SOURCE_PREFIX)}
    assert source, "every architecture keeps its per-sentence state under src_*"
    state = reorder_state(state, torch.tensor([0, 0, 0, 1, 1, 1]))  # three hypotheses each
    for t in range(tgt.size(1)):
        _, state = model.step(tgt[:, t].repeat_interleave(3), state)
    assert {k for k in state if k.startswith(SOURCE_PREFIX)} == set(source)
    for k, v in source.items():
        torch.testing.assert_close(state[k], v)
    for k, v in state.items():
        assert v.size(0) == (2 if k.startswith(SOURCE_PREFIX) else 6), k


def test_batch_permutation(variant):
    model = make(variant)
    src, mask, tgt = batch([5, 3, 7, 2], [4, 6, 2, 5])
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(
        model(src[perm], mask[perm], tgt[perm]), model(src, mask, tgt)[perm], atol=1e-5, rtol=1e-5
    )


def test_attention_weights_are_distributions(variant):
    arch, _ = VARIANTS[variant]
    model = make(variant)
    src, mask, tgt = batch([5, 3, 7], [4, 4, 4])
    state = model.init_state(model.encode(src, mask))
    for t in range(3):
        out, state = model.step(tgt[:, t], state)
        if arch not in ATTENTION_ARCHS:
            assert out.attention is None
            continue
        a = out.attention
        assert a.shape == (3, 7)
        assert (a >= 0).all()
        assert torch.all(a[~mask] == 0)
        torch.testing.assert_close(a.sum(-1), torch.ones(3))


def test_bf16_autocast_close_to_fp32(variant):
    model = make(variant)
    src, mask, tgt = batch([9, 6, 8], [7, 8, 5])
    ref = model(src, mask, tgt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(src, mask, tgt)
        state = model.init_state(model.encode(src, mask))
        out, _ = model.step(tgt[:, 0], state)
    assert torch.isfinite(low).all() and torch.isfinite(out.logits).all()
    err = (low.float() - ref).abs().max() / ref.abs().max()
    assert err < 0.05, f"bf16 relative error {err:.3f}"
    p, q = ref.softmax(-1), low.float().softmax(-1)
    assert (p - q).abs().sum(-1).max() < 0.1  # total variation of next-token distributions


def test_untied_separate_vocabularies(variant):
    arch, cfg = VARIANTS[variant]
    vocab = Vocab(src_size=29, tgt_size=41, shared=False)
    model = build_model(arch, dataclasses.replace(cfg), vocab).eval()
    src = torch.randint(4, 29, (2, 5))
    tgt = torch.randint(4, 41, (2, 3))
    assert model(src, src != PAD_ID, tgt).shape == (2, 3, 41)


def transformer_params(c: TransformerConfig, v: int) -> int:
    d, f = c.d_model, c.ffn_dim
    attn_self = 3 * d * d + 3 * d + d * d + d
    attn_cross = (d * d + d) + (2 * d * d + 2 * d) + (d * d + d)
    ffn = d * f + f + f * d + d
    ln = 2 * d
    enc = c.enc_layers * (attn_self + ffn + 2 * ln)
    dec = c.dec_layers * (attn_self + attn_cross + ffn + 3 * ln)
    final_norms = 2 * ln if c.norm == "pre" else 0
    positions = c.max_positions * d if c.positions == "learned" else 0
    return v * d + v + enc + dec + final_norms + positions  # tied embeddings + output bias


def gru_params(inp: int, h: int, layers: int, dirs: int) -> int:
    total = 0
    for layer in range(layers):
        x = inp if layer == 0 else h * dirs
        total += dirs * (3 * h * x + 3 * h * h + 6 * h)
    return total


def test_parameter_counts_match_formulas():
    for name in ("transformer-pre", "transformer-post-learned-gelu", "transformer-post-marian"):
        _, cfg = VARIANTS[name]
        assert count_parameters(make(name)) == transformer_params(cfg, V)
    c = VARIANTS["seq2seq-gru"][1]
    e, h = c.emb_dim, c.hidden
    expected = (
        V * e
        + gru_params(e, h, c.enc_layers, 2)  # source embedding + biGRU encoder
        + (2 * h * h + h)
        + (h * h * c.dec_layers + h * c.dec_layers)  # to_context, to_init
        + V * e
        + gru_params(e + h, h, c.dec_layers, 1)  # target embedding + decoder
        + ((h + e + h) * e + e)
        + V  # readout + output bias (weight tied)
    )
    assert count_parameters(make("seq2seq-gru")) == expected


@pytest.mark.parametrize(
    "name, through_context", [("seq2seq-gru", True), ("rnn_attention-additive", False)]
)
def test_seq2seq_decoder_sees_source_only_through_context(name, through_context):
    """Two different sources forced to the same context vector (the projection to it made
    constant) give the same logits: the decoder sees nothing else of the source. The same
    surgery on an attention model leaves the sources apart (the test can fail)."""
    model = make(name)
    if through_context:
        memory = model.encode(*batch([6, 3], [5, 5])[:2])
        assert set(memory) == {"context"} and memory["context"].dim() == 2  # one vector each
    projection = model.to_context if through_context else model.to_init
    with torch.no_grad():
        projection.weight.zero_()
        projection.bias.fill_(0.3)
    src1, mask1, tgt = batch([6, 3], [5, 5], seed=1)
    src2, mask2, _ = batch([4, 7], [5, 5], seed=2)
    assert not torch.equal(src1[:, :4], src2[:, :4])
    same = torch.allclose(model(src1, mask1, tgt), model(src2, mask2, tgt))
    assert same is through_context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.3])
def test_cpu_dropout_is_inverted_dropout_with_rate_p(p, dtype):
    drop = Dropout(p)
    x = torch.rand(1000, 1001).add_(0.5).to(dtype).requires_grad_(True)  # odd size: 4 ∤ numel
    torch.manual_seed(3)
    y = drop(x)
    kept = y != 0
    scale = 65536 / (65536 - round(p * 65536))
    assert y.dtype == dtype and y.shape == x.shape
    assert abs(1 - kept.float().mean().item() - p) < 0.003  # 1M draws: sd 0.0005
    assert torch.equal(y[kept], (x[kept] * scale).detach())  # scaled in fp32, rounded once
    assert abs(y.double().mean().item() / x.double().mean().item() - 1) < 0.01  # unbiased
    # Rows and columns are not correlated (each element has its own 16 random bits).
    assert abs(kept.float().mean(0).std().item() - (p * (1 - p) / 1000) ** 0.5) < 0.003
    (grad,) = torch.autograd.grad(y.float().sum(), x)
    assert torch.equal(grad != 0, kept)
    assert torch.equal(grad[kept], torch.full_like(grad[kept], scale))
    torch.manual_seed(3)
    assert torch.equal(drop(x), y)  # the default generator: seeding reproduces the mask
    assert not torch.equal(drop(x), y)
    drop.eval()
    assert drop(x) is x
    assert Dropout(0.0)(x) is x


def test_sinusoidal_positions_come_from_a_table_equal_to_the_formula():
    """When decoding (no autograd): training computes the formula, never syncing on a max."""
    enc = Positions("sinusoidal", 16, 48)  # max_len bounds learned positions only
    enc(torch.arange(100))
    assert enc._sinusoids is None
    with torch.inference_mode():
        for positions in (torch.arange(7), torch.tensor([[3, 0], [5, 1]]), torch.tensor([70, 2])):
            assert torch.equal(enc(positions), sinusoidal(positions, 48))
        assert enc._sinusoids.size(0) == 128  # grown past 64 rows by doubling
        far = torch.tensor([5000, 1, 4999])  # beyond any table so far, and any training length
        assert torch.equal(enc(far), sinusoidal(far, 48))
        assert enc(torch.zeros(0, dtype=torch.long)).shape == (0, 48)


def test_marian_positions_are_a_fixed_table_of_sines_then_cosines():
    """sinusoidal_marian: the interleaved encodings' sines in the first half and cosines in
    the second (Marian's layout, computed in float64 as Marian does), one row per position up
    to max_positions, then the last row; outside the state dict (a constant, as sinusoids)."""
    enc = Positions("sinusoidal_marian", 40, 48)
    positions = torch.arange(40)
    interleaved = sinusoidal(positions, 48)
    halves = enc(positions)
    torch.testing.assert_close(halves[:, :24], interleaved[:, 0::2], atol=2e-6, rtol=0)
    torch.testing.assert_close(halves[:, 24:], interleaved[:, 1::2], atol=2e-6, rtol=0)
    assert torch.equal(
        enc(torch.tensor([[39, 40], [500, 0]])), halves[torch.tensor([[39, 39], [39, 0]])]
    )
    assert list(enc.state_dict()) == []
    with torch.inference_mode():  # decoding reads the same table
        assert torch.equal(enc(positions), halves)


@pytest.mark.parametrize("size", [1, 3, 15, 16, 40])
def test_attention_softmax_equals_torch_softmax(size):
    """Short rows go across rows on CPU (see `softmax`): same values, shape, layout, dtype,
    masked (-inf) positions and gradients as torch.softmax over the last dimension."""
    g = torch.Generator().manual_seed(size)
    x = torch.randn(3, 4, 5, size, generator=g)
    x[0, 0, 0, 1:] = float("-inf")
    ref = torch.softmax(x, -1)
    out = softmax(x)
    torch.testing.assert_close(out, ref, atol=2e-7, rtol=0)
    assert out.shape == x.shape and out.is_contiguous()
    half = softmax(x.bfloat16(), torch.float32)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, torch.softmax(x.bfloat16(), -1, dtype=torch.float32))
    leaf = x.clone().requires_grad_()
    (softmax(leaf) * torch.arange(size)).sum().backward()
    grad = torch.autograd.grad(
        (torch.softmax(x.requires_grad_(), -1) * torch.arange(size)).sum(), x
    )
    torch.testing.assert_close(leaf.grad, grad[0], atol=1e-6, rtol=1e-5)
    assert softmax(torch.zeros(0, size)).shape == (0, size)


def test_cpu_dropout_rate_next_to_one_keeps_a_finite_scale():
    x = torch.ones(4096)
    y = Dropout(1 - 1e-6).train()(x)  # rounds to 65536/65536 dropped unless clamped
    assert torch.isfinite(y).all() and set(y.unique().tolist()) <= {0.0, 65536.0}


def test_decoding_on_fixed_weights_equals_the_autograd_path(variant):
    """Inside fixed_weights (decoding), CPU linear maps run on packed weights; decoding
    steps and teacher forcing give the same logits as F.linear with autograd."""
    model = make(variant)
    src, mask, tgt = batch([5, 3, 7], [6, 6, 6])
    full = model(src, mask, tgt).detach()
    state = model.init_state(model.encode(src, mask))
    steps = []
    for t in range(tgt.size(1)):
        out, state = model.step(tgt[:, t], state)
        steps.append(out.logits.detach())
    with torch.no_grad(), fixed_weights(model):
        torch.testing.assert_close(model(src, mask, tgt), full, atol=1e-5, rtol=1e-5)
        state = model.init_state(model.encode(src, mask))
        for t in range(tgt.size(1)):
            out, state = model.step(tgt[:, t], state)
            torch.testing.assert_close(out.logits, steps[t], atol=1e-5, rtol=1e-5)
        if packed_dtype(src.float()) is not None:  # None: a torch without oneDNN
            assert all(m.weight_cache for m in model.modules() if isinstance(m, Linear))
    assert all(m.weight_cache is None for m in model.modules() if isinstance(m, Linear))
    assert model.state_dict().keys() == make(variant).state_dict().keys()
    copy.deepcopy(model)  # nothing opaque is left behind after decoding
    torch.save(model, io.BytesIO())


def test_fixed_weights_scopes_from_several_threads():
    """Decoding workers open and close scopes on one model at once (nmt.evaluate
    decode_batches); every map ends outside any scope, its packed copies dropped."""
    import threading

    arch, cfg = VARIANTS["transformer-pre"]
    model = build_model(arch, cfg, VOCAB).eval()
    src = torch.randint(4, V, (3, 6))
    with torch.inference_mode():
        expected = model(src, src != PAD_ID, src)

    def work(results: list) -> None:
        for _ in range(30):
            with torch.inference_mode(), fixed_weights(model):
                results.append(torch.allclose(model(src, src != PAD_ID, src), expected, atol=1e-5))

    results: list = []
    threads = [threading.Thread(target=work, args=(results,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 120
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight_cache is None for m in layers)


def test_fixed_weights_last_for_their_scope_only():
    torch.manual_seed(0)
    layer = Linear(16, 24)
    x = torch.randn(3, 5, 16)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True)

    def check() -> None:
        ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), ref)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16: exactly autocast's F.linear
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))

    for _ in range(2):
        with torch.no_grad(), fixed_weights(layer):
            check()
            with fixed_weights(layer):  # nested scopes keep the outer scope's copies
                check()
            if packed_dtype(x) is not None:
                assert set(layer.weight_cache) >= {torch.float32}
        assert layer.weight_cache is None
        # A fused optimizer step moves no version counter: only the scope guards the copies.
        layer(x).square().sum().backward()
        optimizer.step()


@pytest.mark.parametrize("keys", [1, 2, 6, 7, 12])
@pytest.mark.parametrize("queries", [1, 5])
def test_a_small_attention_step_sums_products_as_the_batched_one(keys, queries, monkeypatch):
    """`attend_step` in fp32 on CPU: where its products are below ATen's scalar-loop size
    (queries x keys x 64 < 400: one query against up to 6 cached positions) it takes
    `small_attend_step`, with the batched products' values up to summation order (masked
    positions too); larger ones, and bf16, take the batched products."""
    import nmt.models.transformer as tr

    g = torch.Generator().manual_seed(keys * 10 + queries)
    q = torch.randn(8, 4, queries, 64, generator=g)
    k, v = torch.randn(2, 8, 4, keys, 64, generator=g)
    mask = torch.ones(8, 1, 1, keys, dtype=torch.bool)
    mask[0, ..., keys - 1 :] = keys == 1  # a masked position unless it is the only one
    calls = []
    small = tr.small_attend_step
    monkeypatch.setattr(tr, "small_attend_step", lambda *a: calls.append(1) or small(*a))
    y, w = tr.attend_step(q, k, v, mask)
    assert bool(calls) == (queries * keys * 64 < tr.SMALL_PRODUCT)
    monkeypatch.setattr(tr, "SMALL_PRODUCT", 0)  # the batched products for every size
    y_ref, w_ref = tr.attend_step(q, k, v, mask)
    assert len(calls) <= 1 and y.shape == y_ref.shape and w.shape == w_ref.shape
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(y, y_ref, atol=3e-6, rtol=0)
    assert (w[0, :, :, keys - 1] == 0).all() == (keys > 1)
    monkeypatch.setattr(tr, "SMALL_PRODUCT", 400)
    tr.attend_step(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert len(calls) <= 1  # bf16 rounds each product: never the summed broadcast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_attention_step_traces_broadcast_products(dtype):
    """What `torch.compile` traces of `attend_step` on CPU (`compile_decoding`'s layers) is
    `small_attend_step`'s broadcast products and sums at every size, for inductor to make
    loops of with the cache writes and the softmax: no batched matmul in the graph, and the
    batched products' values up to summation order (fp32; run here by the graph itself)."""
    import nmt.models.transformer as tr

    graphs = []

    def keep(gm, example_inputs):  # a backend that runs the traced graph as it is
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 5, 64, generator=g)  # 5 queries a row against 20 keys: large
    k, v = torch.randn(2, 6, 4, 20, 64, generator=g)
    mask = torch.ones(6, 1, 1, 20, dtype=torch.bool)
    mask[0, ..., 13:] = False
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    y, w = torch.compile(tr.attend_step, backend=keep, dynamic=True, fullgraph=True)(q, k, v, mask)
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    assert graphs and not any("bmm" in op or "matmul" in op for op in ops), ops
    assert any("sum" in op for op in ops)
    y_ref, w_ref = tr.attend_step(q, k, v, mask)  # eager: the batched products
    assert y.dtype == y_ref.dtype == dtype and w.dtype == w_ref.dtype == torch.float32
    if dtype == torch.float32:
        torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(y, y_ref, atol=3e-6, rtol=0)
    assert (w[0, :, :, 13:] == 0).all() and (w_ref[0, :, :, 13:] == 0).all()


# torch's config copy reads its deprecated keys too (torch 2.13)
@pytest.mark.filterwarnings("ignore:.*is deprecated and does not do anything:FutureWarning")
def test_compiled_decoding_traces_each_graph_once(monkeypatch):
    """`compile_decoding`'s graphs are traced once each: the floats the model reads (its
    layer norms' eps, its embedding's norm_type) are constants from the start. Traced as
    symbols, torch's default, each graph was traced a second time once they turned out to be
    constants (a `TensorifyScalarRestartAnalysis`). The encoder's graph, then the first
    step's, with compile_decoding's settings through AOT autograd but without inductor's code
    generation (`aot_eager`), so that it compiles in seconds; the serving tests compile with
    inductor."""
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics
    from torch.fx.experimental import _config as shapes_config

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    model = make("transformer-pre")
    src, src_mask, _ = batch([5, 3], [1, 1])
    configs = (torch._dynamo.config, torch._inductor.config, shapes_config)
    # compile_decoding's process-wide settings: this test's only (each restored at its end)
    with contextlib.ExitStack() as scope:
        for config in configs:
            scope.enter_context(config.patch(config.get_config_copy()))
        torch._dynamo.reset()
        clear_compilation_metrics()  # those of other tests' compiling
        model.compile_decoding()
        with torch.inference_mode():
            state = model.init_state(model.encode(src, src_mask))
            out, _ = model.step(torch.full((2,), BOS_ID), state)
        metrics = get_compilation_metrics()
        torch._dynamo.reset()
    compiled = [m for m in metrics if m.graph_op_count]
    assert len(compiled) == 2 and out.log_probs is not None, metrics
    assert all(not m.restart_reasons for m in compiled), [m.restart_reasons for m in compiled]
