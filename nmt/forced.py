"""`nmt score`: the log-probability a model (or the mean over an ensemble's models) gives to a
given translation of each source line, by forced decoding: one teacher-forced forward pass
per batch, as in training, not a step at a time. For reranking n-best lists, filtering
parallel data, and seeing what a model prefers.

For a pair it gives the total log-probability of the target and its EOS (the negative of
training's loss without label smoothing), per target token (EOS counted), and normalised for
length as beam search ranks hypotheses (the run's decode settings: length penalty and norm).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from nmt.config import DecodeConfig
from nmt.data.batching import pack
from nmt.data.tokenizer import Tokenizer
from nmt.device import autocast
from nmt.models.base import fixed_weights
from nmt.search import SearchOptions, length_penalty
from nmt.special import BOS_ID, EOS_ID, PAD_ID
from nmt.translate import source_batch, source_mask


@dataclass
class PairScore:
    status: str  # "ok", "empty" (a side has no text) or "too long" (over max_len tokens)
    tokens: int  # target tokens scored, EOS included (0 unless ok)
    logprob: float | None = None  # summed over the target's tokens and its EOS
    per_token: float | None = None
    normalized: float | None = None  # logprob / the decode settings' length penalty

    def row(self) -> dict:
        return {
            "logprob": self.logprob,
            "per_token": self.per_token,
            "normalized": self.normalized,
            "tokens": self.tokens,
            "status": self.status,
        }


def target_batch(targets: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """tgt_in[B,T] (BOS + ids) and tgt_out[B,T] (ids + EOS), PAD after them."""
    t = max(len(y) for y in targets) + 1
    tgt_in = torch.full((len(targets), t), PAD_ID, dtype=torch.long)
    tgt_out = torch.full((len(targets), t), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(targets):
        tgt_in[row, 0] = BOS_ID
        tgt_in[row, 1 : len(ids) + 1] = torch.as_tensor(ids, dtype=torch.long)
        tgt_out[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        tgt_out[row, len(ids)] = EOS_ID
    return tgt_in, tgt_out


def score_pairs(
    models: list[torch.nn.Module],
    tokenizer: Tokenizer,
    sources: list[str],
    targets: list[str],
    decode: DecodeConfig,
    batch_tokens: int,
    device: torch.device,
    precision: str,
    max_len: int = 1024,
) -> list[PairScore]:
    """A `PairScore` per (source, target) line, in line order. Several models: the mean of
    their log-probabilities at every target position (how an ensemble decodes)."""
    src_ids = tokenizer.encode_src([s.strip() for s in sources])
    tgt_ids = tokenizer.encode_tgt([t.strip() for t in targets])
    out: list[PairScore] = []
    todo = []
    for i, (x, y) in enumerate(zip(src_ids, tgt_ids)):
        if not x or not y:
            out.append(PairScore("empty", 0))
        elif len(x) + 1 > max_len or len(y) + 1 > max_len:
            out.append(PairScore("too long", 0))
        else:
            out.append(PairScore("ok", len(y) + 1))
            todo.append(i)
    if not todo:
        return out
    costs = np.zeros(len(src_ids), dtype=np.int64)
    for i in todo:
        costs[i] = max(len(src_ids[i]), len(tgt_ids[i])) + 1
    order = np.array(sorted(todo, key=lambda i: (costs[i], i)))
    # what normalises a score; the search's own settings (beam, n-best, patience) do not
    # apply to given translations, nor do their checks
    opts = SearchOptions(length_penalty=decode.length_penalty, length_norm=decode.length_norm)
    with contextlib.ExitStack() as scope:
        for model in models:  # fixed weights: packed (or quantized) once for all batches
            model.eval()
            scope.enter_context(fixed_weights(model))
        scope.enter_context(torch.inference_mode())
        scope.enter_context(autocast(device, precision))
        for idx in pack(order, costs, batch_tokens):
            src = source_batch([src_ids[i] for i in idx]).to(device)
            tgt_in, tgt_out = (t.to(device) for t in target_batch([tgt_ids[i] for i in idx]))
            lengths = torch.tensor([len(src_ids[i]) + 1 for i in idx])
            nll = torch.stack(
                [
                    F.cross_entropy(
                        model(src, source_mask(src), tgt_in, lengths).float().transpose(1, 2),
                        tgt_out,
                        ignore_index=PAD_ID,
                        reduction="none",
                    )  # [B,T], 0 at padding
                    for model in models
                ]
            ).mean(0)
            for i, total in zip(idx, (-nll.sum(1, dtype=torch.float64)).tolist()):
                pair = out[int(i)]
                pair.logprob = total
                pair.per_token = total / pair.tokens
                pair.normalized = total / float(length_penalty(float(pair.tokens), opts))
    return out
