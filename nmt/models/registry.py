"""`model.arch` -> builder: the only place configs (`nmt.models.configs`) meet constructors.

Adding an architecture: its config dataclass in `nmt.models.configs`, one model file, one
builder and one entry here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from nmt.models.base import Vocab, count_parameters
from nmt.models.configs import (
    CONFIGS,
    ModelConfig,
    RNNAttentionConfig,
    Seq2SeqConfig,
    TransformerConfig,
    arch_of,
)
from nmt.models.rnn_attention import RNNAttention
from nmt.models.seq2seq import Seq2Seq
from nmt.models.transformer import Transformer

log = logging.getLogger(__name__)


def build_seq2seq(c: Seq2SeqConfig, vocab: Vocab) -> nn.Module:
    return Seq2Seq(
        src_vocab=vocab.src_size,
        tgt_vocab=vocab.tgt_size,
        cell=c.cell,
        emb_dim=c.emb_dim,
        hidden=c.hidden,
        enc_layers=c.enc_layers,
        dec_layers=c.dec_layers,
        bidirectional=c.bidirectional,
        dropout=c.dropout,
        tie_embeddings=c.tie_embeddings,
    )


def build_rnn_attention(c: RNNAttentionConfig, vocab: Vocab) -> nn.Module:
    return RNNAttention(
        src_vocab=vocab.src_size,
        tgt_vocab=vocab.tgt_size,
        cell=c.cell,
        emb_dim=c.emb_dim,
        enc_hidden=c.enc_hidden,
        dec_hidden=c.dec_hidden,
        enc_layers=c.enc_layers,
        dec_layers=c.dec_layers,
        attention=c.attention,
        attn_dim=c.attn_dim,
        input_feed=c.input_feed,
        dropout=c.dropout,
        tie_embeddings=c.tie_embeddings,
    )


def build_transformer(c: TransformerConfig, vocab: Vocab) -> nn.Module:
    return Transformer(
        src_vocab=vocab.src_size,
        tgt_vocab=vocab.tgt_size,
        d_model=c.d_model,
        heads=c.heads,
        enc_layers=c.enc_layers,
        dec_layers=c.dec_layers,
        ffn_dim=c.ffn_dim,
        dropout=c.dropout,
        attn_dropout=c.attn_dropout,
        activation_dropout=c.activation_dropout,
        activation=c.activation,
        norm=c.norm,
        positions=c.positions,
        max_positions=c.max_positions,
        scale_embeddings=c.scale_embeddings,
        share_embeddings=c.tie_embeddings and vocab.shared,
        tie_output=c.tie_embeddings,
    )


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "seq2seq": build_seq2seq,
    "rnn_attention": build_rnn_attention,
    "transformer": build_transformer,
}
assert BUILDERS.keys() == CONFIGS.keys(), "every configured architecture needs a builder"


def build_model(arch: str, config: ModelConfig, vocab: Vocab) -> nn.Module:
    """The `arch` model of `config` for `vocab`."""
    if arch_of(config) != arch:
        raise ValueError(f"a {type(config).__name__} does not configure a {arch} model")
    model = BUILDERS[arch](config, vocab)
    log.debug("built %s model with %s parameters", arch, f"{count_parameters(model):,}")
    return model
