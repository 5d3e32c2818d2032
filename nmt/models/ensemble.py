"""Several trained models behind the one model contract: at each step the mean of their
log-probabilities (as OpenNMT-py and Marian ensemble; not renormalised), so beam search,
n-best, sampling and every search constraint work unchanged. Members may be of different
architectures as long as they share the vocabulary (the caller checks the tokenizer).

Each member's state entries live in the ensemble's state under names that keep their kind
(`src_*`, `cache_*`, per hypothesis): member i's `src_k0` is `src_3:k0` ... `src_{i}:k0`, its
`pos` is `{i}:pos`; so `reorder_state` treats them as it treats the member's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from nmt.models.base import CACHE_PREFIX, SOURCE_PREFIX, State, StepOutput, step_log_probs


def _own(i: int, key: str) -> str:
    for prefix in (SOURCE_PREFIX, CACHE_PREFIX):
        if key.startswith(prefix):
            return f"{prefix}{i}:{key[len(prefix) :]}"
    return f"{i}:{key}"


def _member(i: int, state: State) -> State:
    """Member i's entries of an ensemble state, under the member's own names."""
    out = {}
    for key, value in state.items():
        prefix = next((p for p in (SOURCE_PREFIX, CACHE_PREFIX) if key.startswith(p)), "")
        index, _, name = key[len(prefix) :].partition(":")
        if index == str(i):
            out[prefix + name] = value
    return out


@dataclass
class EnsembleOutput(StepOutput):
    """An ensemble's step: its members' outputs kept, their attention averaged only when
    asked (`StepOutput.attention`; a search never asks), over the members that have one."""

    members: list[StepOutput] = field(default_factory=list)

    @property
    def attention(self) -> Tensor | None:
        maps = [o.attention.float() for o in self.members if o.attention is not None]
        return torch.stack(maps).mean(0) if maps else None


class Ensemble(nn.Module):
    """The mean of its members' next-token log-probabilities (and of their attention, over
    the members that have one)."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        if len(models) < 2:
            raise ValueError("an ensemble needs at least two models")
        self.members = nn.ModuleList(models)

    def _merge(self, states: list[State]) -> State:
        return {_own(i, k): v for i, s in enumerate(states) for k, v in s.items()}

    # -- contract --------------------------------------------------------------------------
    def encode(self, src: Tensor, src_mask: Tensor, src_lengths: Tensor | None = None) -> State:
        return self._merge([m.encode(src, src_mask, src_lengths) for m in self.members])

    def init_state(self, memory: State) -> State:
        return self._merge([m.init_state(_member(i, memory)) for i, m in enumerate(self.members)])

    def step(self, prev: Tensor, state: State) -> tuple[StepOutput, State]:
        outputs, states = [], []
        for i, member in enumerate(self.members):
            out, new = member.step(prev, _member(i, state))
            outputs.append(out)
            states.append(new)
        logp = torch.stack([step_log_probs(o) for o in outputs]).mean(0)  # [N,V]
        return EnsembleOutput(logp, None, log_probs=logp, members=outputs), self._merge(states)

    def join(self, a: State, b: State) -> State:
        return self._merge(
            [m.join(_member(i, a), _member(i, b)) for i, m in enumerate(self.members)]
        )

    def forward(
        self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, src_lengths: Tensor | None = None
    ) -> Tensor:
        """Teacher forcing: the mean of the members' log-probabilities [B,T,V]."""
        outs = [m(src, src_mask, tgt_in, src_lengths).float().log_softmax(-1) for m in self.members]
        return torch.stack(outs).mean(0)
