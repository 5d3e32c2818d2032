"""RNN encoder-decoder with attention (Bahdanau et al. 2015; Luong et al. 2015 scores).

A bidirectional RNN encodes the source into states h_i. At each target step the previous
decoder state s_{t-1} queries them: a_t = softmax(score(s_{t-1}, h)), c_t = sum_i a_{t,i} h_i;
then s_t = RNN([y_{t-1}; c_t (; o_{t-1} with input feeding)], s_{t-1}) and
o_t = tanh(W_o [s_t; c_t; y_{t-1}]) gives the logits. The query-independent keys (U h_i) are
computed once per sentence in `init_state`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt.models.base import (
    State,
    StepOutput,
    fixed_weights,
    hypotheses_per_sentence,
    join_states,
    source_state,
)
from nmt.models.layers import (
    RNN,
    Dropout,
    Embedding,
    Linear,
    OutputProjection,
    RecurrentAttention,
    RNNEncoder,
)


class RNNAttention(nn.Module):
    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        cell: str,
        emb_dim: int,
        enc_hidden: int,
        dec_hidden: int,
        enc_layers: int,
        dec_layers: int,
        attention: str,
        attn_dim: int,
        input_feed: bool,
        dropout: float,
        tie_embeddings: bool,
    ) -> None:
        super().__init__()
        self.encoder = RNNEncoder(src_vocab, emb_dim, enc_hidden, enc_layers, cell, True, dropout)
        mem_dim = self.encoder.out_dim
        self.to_init = Linear(mem_dim, dec_hidden * dec_layers)
        self.attention = RecurrentAttention(attention, dec_hidden, mem_dim, attn_dim)
        self.tgt_embed = Embedding(tgt_vocab, emb_dim)
        feed_dim = emb_dim if input_feed else 0
        self.decoder = RNN(
            cell, emb_dim + mem_dim + feed_dim, dec_hidden, dec_layers, False, dropout
        )
        self.readout = Linear(dec_hidden + mem_dim + emb_dim, emb_dim)
        self.output = OutputProjection(
            emb_dim, tgt_vocab, self.tgt_embed if tie_embeddings else None
        )
        self.dropout = Dropout(dropout)
        self.dec_layers = dec_layers
        self.dec_hidden = dec_hidden
        self.emb_dim = emb_dim
        self.input_feed = input_feed
        self.is_lstm = cell == "lstm"

    # -- contract --------------------------------------------------------------------------
    def encode(self, src: Tensor, src_mask: Tensor, src_lengths: Tensor | None = None) -> State:
        memory, final = self.encoder(src, src_mask, src_lengths)  # [B,S,M], [B,M]
        return {"memory": memory, "src_mask": src_mask, "final": final}

    def init_state(self, memory: State) -> State:
        final = memory["final"]
        batch = final.size(0)
        s0 = torch.tanh(self.to_init(final)).view(batch, self.dec_layers, self.dec_hidden)
        state = {
            "src_memory": memory["memory"],  # [B,S,M]
            "src_keys": self.attention.keys(memory["memory"]),  # [B,S,A], once per sentence
            "src_mask": memory["src_mask"],  # [B,S]
            "hidden": s0,  # [B,L,H]
        }
        if self.is_lstm:
            state["cell"] = torch.zeros_like(s0)
        if self.input_feed:
            state["feed"] = s0.new_zeros(batch, self.emb_dim)  # o_{t-1} [B,E]
        return state

    def step(self, prev: Tensor, state: State) -> tuple[StepOutput, State]:
        y = self.dropout(self.tgt_embed(prev))  # [B,E]
        readout, weights, new_state = self._step(y, state)
        return StepOutput(self.output(self.dropout(readout)), weights), new_state

    def join(self, a: State, b: State) -> State:
        return join_states(a, b, {"src_memory": 1, "src_keys": 1, "src_mask": 1})

    def forward(
        self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, src_lengths: Tensor | None = None
    ) -> Tensor:
        state = self.init_state(self.encode(src, src_mask, src_lengths))
        y = self.dropout(self.tgt_embed(tgt_in))  # [B,T,E]
        readouts = []
        # The recurrence is sequential, the projection is not. The decoder's weights are fixed
        # for this forward: cast once for all positions where the RNN runs in a cast dtype.
        with fixed_weights(self.decoder):
            for t in range(tgt_in.size(1)):
                readout, _, state = self._step(y[:, t], state)
                readouts.append(readout)
        return self.output(self.dropout(torch.stack(readouts, 1)))  # [B,T,V]

    # -- internals -------------------------------------------------------------------------
    def _step(self, y: Tensor, state: State) -> tuple[Tensor, Tensor, State]:
        """y[N,E] embedded previous token of N = B*w hypotheses -> readout o_t[N,E],
        attention[N,S], new state. The w hypotheses of a sentence are w queries of one
        attention over its source (keys and memory [B,S,*] read once per sentence)."""
        hidden = state["hidden"]  # [N,L,H]
        n = hidden.size(0)
        b = state["src_mask"].size(0)
        w = hypotheses_per_sentence(n, state["src_mask"])
        query = hidden[:, -1, :].reshape(b, w, -1)  # s_{t-1} of the top layer [B,w,H]
        context, weights = self.attention(
            query, state["src_keys"], state["src_memory"], state["src_mask"]
        )
        context, weights = context.reshape(n, -1), weights.reshape(n, -1)  # [N,M], [N,S]
        parts = [y, context] + ([state["feed"]] if self.input_feed else [])
        out, hidden, cell = self.decoder(
            torch.cat(parts, -1)[:, None, :], hidden, state.get("cell")
        )
        out = out[:, 0]  # s_t [B,H]
        readout = torch.tanh(self.readout(torch.cat([self.dropout(out), context, y], -1)))  # [B,E]
        new_state = source_state(state)
        new_state["hidden"] = hidden
        if cell is not None:
            new_state["cell"] = cell
        if self.input_feed:
            new_state["feed"] = readout
        return readout, weights, new_state
