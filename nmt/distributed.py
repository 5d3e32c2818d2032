"""Data-parallel training under torchrun: the process group, the few collectives the trainer
needs, and the per-rank RNG states that make a resumed run exact.

One process group serves both kinds of tensors: host values (stop flags) go through gloo,
device tensors through NCCL on CUDA (`cpu:gloo,cuda:nccl`), so agreeing on a host flag never
waits for the GPU. The group's timeout is explicit (`train.dist_timeout_minutes`): the other
ranks wait in a collective while rank 0 validates or averages checkpoints.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nmt import NMTError


@dataclass(frozen=True)
class World:
    """This process' place among the training processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> World:
    """The world torchrun describes in the environment (one process without it)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    return World(rank, size, int(os.environ.get("LOCAL_RANK", rank)))


def rank_device(device: torch.device, world: World) -> torch.device:
    """The device of this rank: its own GPU (LOCAL_RANK) when training on CUDA with several
    processes, else `device`."""
    if device.type == "cuda" and world.size > 1:
        count = torch.cuda.device_count()
        if world.local_rank >= count:
            raise NMTError(
                f"rank {world.rank} is process {world.local_rank} of its machine (LOCAL_RANK), "
                f"which has {count} GPU(s); start at most {count} processes a machine "
                f"(torchrun --nproc_per_node {count})"
            )
        return torch.device("cuda", world.local_rank)
    return device


def join(world: World, device: torch.device, timeout_minutes: float) -> None:
    """Join the process group (several processes only)."""
    if world.size == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group(backend, timeout=timeout)


def leave(world: World) -> None:
    """Wait for every rank, then leave the process group."""
    if world.size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def host_sum(values: list[float], world: World) -> list[float]:
    """Element-wise sums over the ranks of host values (one gloo all-reduce, no device wait)."""
    if world.size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def device_sum_(t: torch.Tensor, world: World) -> torch.Tensor:
    """Sum a device tensor over the ranks in place (queued on the device: no host wait)."""
    if world.size > 1:
        dist.all_reduce(t)
    return t


def gather(obj: Any, world: World) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if world.size == 1:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


# -- RNG states ---------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process' RNG states: Python, NumPy, torch's CPU generator and, on CUDA, the
    generator of this rank's device only (not every visible device: a resume on a machine
    with another number of GPUs must find what it needs)."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore `rng_state`'s output. A CUDA state is restored on `device` when there is one;
    checkpoints of earlier versions hold a list of every visible device's state: the entry
    of `device`'s index is used when it exists."""
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if device.type != "cuda" or cuda is None:
        return
    if isinstance(cuda, (list, tuple)):
        index = device.index or 0
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def restore_rngs(
    saved: list[dict[str, Any]], world: World, device: torch.device, seed: int, step: int
) -> bool:
    """Restore this rank's RNG states from a checkpoint's per-rank list. Exact (True) when
    the run is resumed by as many processes as saved it; otherwise every rank is seeded anew
    from (seed, step, rank) and False is returned: the continuation is not bit-exact."""
    if len(saved) == world.size:
        set_rng_state(saved[world.rank], device)
        return True
    seed_everything(int(np.random.SeedSequence([seed, step, world.rank]).generate_state(1)[0]))
    return False


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
