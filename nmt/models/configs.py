"""The hyperparameters of each architecture: frozen dataclasses that import no torch, so the
recipe config (`nmt.config`) and the data pipeline load without the models. `CONFIGS` names
them; `nmt.models.registry` pairs each name with the builder of its model.

Adding an architecture: its dataclass and `CONFIGS` entry here, its model file, its builder in
the registry, a recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Seq2SeqConfig:
    """RNN encoder-decoder with a fixed context vector (`nmt.models.seq2seq`)."""

    cell: Literal["gru", "lstm"] = "gru"
    emb_dim: int = 256
    hidden: int = 512
    enc_layers: int = 1
    dec_layers: int = 1
    bidirectional: bool = True
    dropout: float = 0.2
    tie_embeddings: bool = True  # tie target embedding and output projection

    def __post_init__(self) -> None:
        if min(self.emb_dim, self.hidden, self.enc_layers, self.dec_layers) < 1:
            raise ValueError("emb_dim, hidden, enc_layers and dec_layers must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout must be in [0, 1)")


@dataclass(frozen=True)
class RNNAttentionConfig:
    """Bidirectional RNN encoder, attentional RNN decoder (`nmt.models.rnn_attention`)."""

    cell: Literal["gru", "lstm"] = "gru"
    emb_dim: int = 256
    enc_hidden: int = 256  # per direction; the encoder is bidirectional
    dec_hidden: int = 512
    enc_layers: int = 1
    dec_layers: int = 1
    attention: Literal["additive", "general", "dot"] = "additive"
    attn_dim: int = 256  # additive attention only
    input_feed: bool = False
    dropout: float = 0.2
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if (
            min(self.emb_dim, self.enc_hidden, self.dec_hidden, self.enc_layers, self.dec_layers)
            < 1
        ):
            raise ValueError("dimensions and layer counts must be >= 1")
        if self.attention == "dot" and 2 * self.enc_hidden != self.dec_hidden:
            raise ValueError("dot attention needs dec_hidden == 2 * enc_hidden")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout must be in [0, 1)")


@dataclass(frozen=True)
class TransformerConfig:
    """Transformer encoder-decoder (`nmt.models.transformer`)."""

    d_model: int = 256
    heads: int = 4
    enc_layers: int = 3
    dec_layers: int = 3
    ffn_dim: int = 1024
    dropout: float = 0.1
    attn_dropout: float = 0.0
    activation_dropout: float = 0.0  # inside the FFN, after the activation
    activation: Literal["relu", "gelu"] = "relu"
    norm: Literal["pre", "post"] = "pre"
    # sinusoidal: sin/cos interleaved, any length; learned: max_positions entries;
    # sinusoidal_marian: Marian's fixed table of max_positions entries, sines then cosines (what
    # a Hugging Face Marian export needs, see `nmt export`). Past max_positions, learned and
    # sinusoidal_marian positions reuse their last entry.
    positions: Literal["sinusoidal", "learned", "sinusoidal_marian"] = "sinusoidal"
    max_positions: int = 1024
    scale_embeddings: bool = True
    tie_embeddings: bool = True  # ties source, target and output embeddings (joint vocabulary)

    def __post_init__(self) -> None:
        sizes = (self.d_model, self.heads, self.enc_layers, self.dec_layers, self.ffn_dim)
        if min(*sizes, self.max_positions) < 1:
            raise ValueError("dimensions, layer counts and max_positions must be >= 1")
        if self.d_model % self.heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads})")
        if not all(
            0.0 <= p < 1.0 for p in (self.dropout, self.attn_dropout, self.activation_dropout)
        ):
            raise ValueError("dropout values must be in [0, 1)")


ModelConfig = Seq2SeqConfig | RNNAttentionConfig | TransformerConfig

CONFIGS: dict[str, type] = {
    "seq2seq": Seq2SeqConfig,
    "rnn_attention": RNNAttentionConfig,
    "transformer": TransformerConfig,
}


def arch_of(model_config: ModelConfig) -> str:
    """The architecture name of a model config."""
    for name, cls in CONFIGS.items():
        if type(model_config) is cls:
            return name
    raise ValueError(f"model config {type(model_config).__name__} is not registered")
