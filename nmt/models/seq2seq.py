"""Vanilla RNN encoder-decoder with a fixed context vector (Cho et al. 2014). No attention.

The encoder's final state is projected into one vector c per sentence. The decoder sees the
source only through c: at every step (s_t = g(y_{t-1}, s_{t-1}, c)) and at the output layer.
This is the bottleneck model: no per-position encoder state ever reaches the decoder.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt.models.base import (
    State,
    StepOutput,
    hypotheses_per_sentence,
    join_states,
    source_state,
)
from nmt.models.layers import RNN, Dropout, Embedding, Linear, OutputProjection, RNNEncoder


class Seq2Seq(nn.Module):
    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        cell: str,
        emb_dim: int,
        hidden: int,
        enc_layers: int,
        dec_layers: int,
        bidirectional: bool,
        dropout: float,
        tie_embeddings: bool,
    ) -> None:
        super().__init__()
        self.encoder = RNNEncoder(
            src_vocab, emb_dim, hidden, enc_layers, cell, bidirectional, dropout
        )
        self.to_context = Linear(self.encoder.out_dim, hidden)  # final state -> c
        self.to_init = Linear(hidden, hidden * dec_layers)  # c -> s_0 for each layer
        self.tgt_embed = Embedding(tgt_vocab, emb_dim)
        self.decoder = RNN(cell, emb_dim + hidden, hidden, dec_layers, False, dropout)
        self.readout = Linear(hidden + emb_dim + hidden, emb_dim)  # [s_t; y_{t-1}; c]
        self.output = OutputProjection(
            emb_dim, tgt_vocab, self.tgt_embed if tie_embeddings else None
        )
        self.dropout = Dropout(dropout)
        self.dec_layers = dec_layers
        self.hidden = hidden
        self.is_lstm = cell == "lstm"

    # -- contract --------------------------------------------------------------------------
    def encode(self, src: Tensor, src_mask: Tensor, src_lengths: Tensor | None = None) -> State:
        _, final = self.encoder(src, src_mask, src_lengths)  # [B, dirs*H]; outputs discarded
        return {"context": torch.tanh(self.to_context(final))}  # c [B,H]

    def init_state(self, memory: State) -> State:
        c = memory["context"]  # [B,H]
        s0 = torch.tanh(self.to_init(c)).view(c.size(0), self.dec_layers, self.hidden)  # [B,L,H]
        state = {"src_context": c, "hidden": s0}
        if self.is_lstm:
            state["cell"] = torch.zeros_like(s0)
        return state

    def step(self, prev: Tensor, state: State) -> tuple[StepOutput, State]:
        logits, new_state = self._decode(prev[:, None], state)  # [B,1,V]
        return StepOutput(logits[:, 0], None), new_state

    def join(self, a: State, b: State) -> State:
        return join_states(a, b, {})  # nothing per source position

    def forward(
        self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, src_lengths: Tensor | None = None
    ) -> Tensor:
        state = self.init_state(self.encode(src, src_mask, src_lengths))
        logits, _ = self._decode(tgt_in, state)
        return logits  # [B,T,V]

    # -- internals -------------------------------------------------------------------------
    def _decode(self, tgt_in: Tensor, state: State) -> tuple[Tensor, State]:
        """tgt_in[N,T] of N = B*w hypotheses -> logits[N,T,V]; the whole sequence in one RNN
        call (c is known)."""
        c = state["src_context"]  # [B,H], one row per sentence
        w = hypotheses_per_sentence(tgt_in.size(0), c)
        if w > 1:
            c = c.repeat_interleave(w, 0)  # [N,H]
        y = self.dropout(self.tgt_embed(tgt_in))  # [N,T,E]
        c_t = c[:, None, :].expand(-1, y.size(1), -1)  # [N,T,H]
        out, hidden, cell = self.decoder(
            torch.cat([y, c_t], -1), state["hidden"], state.get("cell")
        )
        readout = torch.tanh(self.readout(torch.cat([self.dropout(out), y, c_t], -1)))  # [N,T,E]
        new_state = {**source_state(state), "hidden": hidden}
        if cell is not None:
            new_state["cell"] = cell
        return self.output(self.dropout(readout)), new_state
