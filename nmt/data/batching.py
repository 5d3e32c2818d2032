"""Token-budget batching: bucketed by length, deterministic per (seed, epoch), resumable,
shardable across distributed ranks. A prepared split is read with pyarrow alone (see
`EncodedSplit.load`); decoding packs its batches with `pack`.

An example costs `max(src_len + 1, tgt_len + 1)` positions (EOS on the source; BOS/EOS
shifted on the target); a batch costs `size * max cost`, padding included, and never exceeds
the budget unless a single example does.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from nmt import NMTError, first_line
from nmt.special import BOS_ID, EOS_ID, PAD_ID

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

    from nmt.config import TrainConfig


@dataclass
class Batch:
    src: Tensor  # [B,S] ids + EOS, right-padded
    src_mask: Tensor  # [B,S] True at real tokens
    tgt_in: Tensor  # [B,T] BOS + ids
    tgt_out: Tensor  # [B,T] ids + EOS (PAD where tgt_in is padding)
    indices: np.ndarray  # [B] example indices in the split
    tgt_tokens: int  # real target tokens (loss positions)
    src_lengths: Tensor | None = None  # [B] real source tokens, EOS included; stays on the host

    def to(self, device: torch.device) -> Batch:
        """The batch on `device` (asynchronous copies from pinned memory on CUDA); the
        source lengths stay on the host, where packed RNNs need them."""
        nb = device.type == "cuda"
        return Batch(
            self.src.to(device, non_blocking=nb),
            self.src_mask.to(device, non_blocking=nb),
            self.tgt_in.to(device, non_blocking=nb),
            self.tgt_out.to(device, non_blocking=nb),
            self.indices,
            self.tgt_tokens,
            self.src_lengths,
        )


def _numbers(array: pa.Array) -> np.ndarray:
    """A primitive Arrow array without nulls as a numpy view of its data. Not `to_numpy`:
    pyarrow (26) imports pandas there when it is installed, 64 MB of resident memory that
    training would keep for nothing."""
    dtype = np.dtype(str(array.type))  # int32 or int64
    data = array.buffers()[1]
    return np.frombuffer(data, dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = _numbers(array.offsets).astype(np.int64)
    values = _numbers(array.values).astype(np.int64, copy=False)
    return offsets - offsets[0], values[offsets[0] : offsets[-1]] if len(offsets) else values


class EncodedSplit:
    """Token ids of one prepared split in flat arrays (ids of row i: values[off[i]:off[i+1]]),
    over its Arrow table (`table`: the text and ids as `nmt prepare` saved them)."""

    def __init__(self, table: pa.Table) -> None:
        self.src_offsets, self.src_values = _flat(table.column("src_ids"))
        self.tgt_offsets, self.tgt_values = _flat(table.column("tgt_ids"))
        self.src_lens = np.diff(self.src_offsets)
        self.tgt_lens = np.diff(self.tgt_offsets)
        self.table = table

    @classmethod
    def from_dataset(cls, ds: datasets.Dataset) -> EncodedSplit:
        """The split of a `datasets.Dataset` (its rows in their selected order)."""
        return cls(ds.flatten_indices().data.table if ds._indices is not None else ds.data.table)

    @classmethod
    def load(cls, path: Path) -> EncodedSplit:
        """The split `datasets.Dataset.save_to_disk` wrote in `path` (as `nmt prepare` does):
        the Arrow stream files state.json lists, in its order, memory-mapped, read with pyarrow
        alone. Importing `datasets` (with pandas, aiohttp and the Hub client) added 78-80 MB of
        resident memory and 0.6 s to every process that trains or scores on prepared data,
        which needs none of it."""
        import pyarrow as pa

        try:
            state = json.loads((path / "state.json").read_text())
            files = [path / shard["filename"] for shard in state["_data_files"]]
            tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
            table = pa.concat_tables(tables)  # one file: the same table, no copy
            for column in ("src", "tgt", "src_ids", "tgt_ids"):
                table.column(column)
        except (OSError, ValueError, KeyError, TypeError, IndexError, pa.ArrowException) as e:
            raise NMTError(
                f"the prepared split in {path} cannot be read ({first_line(e)}); delete "
                f"{path.parent.parent} and run `nmt prepare` again"
            ) from None
        return cls(table)

    def __len__(self) -> int:
        return len(self.src_lens)

    def texts(self, column: str) -> list[str]:
        return self.table.column(column).to_pylist()

    def src_ids(self, i: int) -> np.ndarray:
        return self.src_values[self.src_offsets[i] : self.src_offsets[i + 1]]

    def tgt_ids(self, i: int) -> np.ndarray:
        return self.tgt_values[self.tgt_offsets[i] : self.tgt_offsets[i + 1]]

    def collate(self, indices: np.ndarray, pin: bool = False) -> Batch:
        """The padded batch of examples `indices`; in pinned (page-locked) host memory with
        `pin`, so that a copy to CUDA with non_blocking=True is asynchronous."""
        b = len(indices)
        s = int(self.src_lens[indices].max()) + 1
        t = int(self.tgt_lens[indices].max()) + 1
        src = np.full((b, s), PAD_ID, dtype=np.int64)
        tgt_in = np.full((b, t), PAD_ID, dtype=np.int64)
        tgt_out = np.full((b, t), PAD_ID, dtype=np.int64)
        for row, i in enumerate(indices):
            x, y = self.src_ids(i), self.tgt_ids(i)
            src[row, : len(x)] = x
            src[row, len(x)] = EOS_ID
            tgt_in[row, 0] = BOS_ID
            tgt_in[row, 1 : len(y) + 1] = y
            tgt_out[row, : len(y)] = y
            tgt_out[row, len(y)] = EOS_ID
        src_t, tgt_in_t, tgt_out_t = map(torch.from_numpy, (src, tgt_in, tgt_out))
        mask = src_t != PAD_ID
        if pin:
            src_t, mask, tgt_in_t, tgt_out_t = (
                x.pin_memory() for x in (src_t, mask, tgt_in_t, tgt_out_t)
            )
        return Batch(
            src=src_t,
            src_mask=mask,
            tgt_in=tgt_in_t,
            tgt_out=tgt_out_t,
            indices=np.asarray(indices),
            tgt_tokens=int(self.tgt_lens[indices].sum()) + b,
            src_lengths=torch.from_numpy(self.src_lens[indices] + 1),
        )


def pack(order: np.ndarray, costs: np.ndarray, budget: int, multiple: int = 1) -> list[np.ndarray]:
    """Greedily cut `order` (sorted by cost) into batches with size * max cost <= budget.

    With `multiple` > 1 a batch cut by the budget holds a multiple of `multiple` examples when
    it holds at least that many; the examples left over begin the next batch (as fairseq's
    --required-batch-size-multiple). Its padded sizes, examples x longest, are then
    multiples of it too: fewer distinct matrix heights over an epoch, so fewer kernels that
    oneDNN makes and keeps for each (and rows aligned for GPU matrix units)."""
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for pos, i in enumerate(order):
        c = int(costs[i])
        while pos > start and (pos - start + 1) * max(longest, c) > budget:
            size = pos - start
            if size >= multiple:
                size -= size % multiple
            batches.append(order[start : start + size])
            start += size
            longest = int(costs[order[start:pos]].max()) if pos > start else 0
        longest = max(longest, c)
    if start < len(order):
        batches.append(order[start:])
    return batches


class TokenBatches:
    """The batches of each epoch for one rank.

    Each epoch: a random permutation from (seed, epoch) breaks ties, examples are sorted by
    (source, target) length and packed to the token budget (in multiples of `multiple`
    examples, see `pack`), then batch order is shuffled. Every rank computes the same list
    and takes every `world`-th batch; the list is first made divisible by `world` by
    splitting the largest batches, so each example appears exactly once per epoch across
    ranks and every rank takes the same number of steps.
    """

    def __init__(
        self,
        src_lens: np.ndarray,
        tgt_lens: np.ndarray,
        batch_tokens: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world: int = 1,
        multiple: int = 1,
    ) -> None:
        self.src_lens = np.asarray(src_lens)
        self.tgt_lens = np.asarray(tgt_lens)
        self.costs = np.maximum(self.src_lens, self.tgt_lens) + 1
        self.batch_tokens = batch_tokens
        self.seed, self.shuffle, self.rank, self.world = seed, shuffle, rank, world
        self.multiple = multiple
        if len(self.costs) < world:
            raise NMTError(
                f"{len(self.costs)} examples cannot be shared by {world} ranks (every rank needs "
                "one); use fewer processes"
            )

    @classmethod
    def of(
        cls,
        split: EncodedSplit,
        t: TrainConfig,
        shuffle: bool = True,
        rank: int = 0,
        world: int = 1,
    ) -> TokenBatches:
        """The batches of `split` as training packs them: `t`'s budget, seed and multiple."""
        return cls(
            split.src_lens,
            split.tgt_lens,
            t.batch_tokens,
            t.seed,
            shuffle,
            rank,
            world,
            t.batch_multiple,
        )

    def all_batches(self, epoch: int) -> list[np.ndarray]:
        """The whole epoch's batches (all ranks) in the order they are consumed."""
        n = len(self.costs)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(n)
            order = perm[np.lexsort((self.tgt_lens[perm], self.src_lens[perm]))]
        else:
            order = np.lexsort((np.arange(n), self.tgt_lens, self.src_lens))
        batches = pack(order, self.costs, self.batch_tokens, self.multiple)
        while len(batches) % self.world:
            largest = max(range(len(batches)), key=lambda k: len(batches[k]))
            half = len(batches[largest]) // 2
            if half == 0:
                raise NMTError(
                    f"{len(batches)} batches of one example each cannot be shared evenly by "
                    f"{self.world} ranks; raise train.batch_tokens or use fewer processes"
                )
            batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, 1])
            batches = [batches[k] for k in rng.permutation(len(batches))]
        return batches

    def epoch(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        """This rank's batches of `epoch`, from its `start`-th batch on (resume)."""
        return self.all_batches(epoch)[self.rank :: self.world][start:]

    def tokens(self, batch: np.ndarray) -> int:
        """Target tokens of a batch (EOS included), as `EncodedSplit.collate` counts them."""
        return int(self.tgt_lens[batch].sum()) + len(batch)

    def steps(
        self, epoch: int, accumulate: int, start: int = 0
    ) -> list[tuple[list[np.ndarray], int]]:
        """This rank's optimizer steps of `epoch` from its `start`-th batch: the batches of
        each step (`accumulate` of them, fewer at the end) and the target tokens of that step
        on all ranks. Every rank computes the same lists, so ranks agree on every step's
        token count without talking."""
        batches = self.all_batches(epoch)
        per_rank = [batches[r :: self.world][start:] for r in range(self.world)]
        out = []
        for g in range(0, len(per_rank[self.rank]), accumulate):
            groups = [mine[g : g + accumulate] for mine in per_rank]
            out.append((groups[self.rank], sum(self.tokens(b) for grp in groups for b in grp)))
        return out

    def resume_start(self, epoch: int, consumed: int, saved_world: int) -> int:
        """Where this rank resumes `epoch` when `consumed` batches per rank were trained by
        `saved_world` processes: `consumed` itself for the same world; for another, the
        batch of this world's list at the same share of the epoch (the epoch's batches are
        cut for the world, so this is approximate)."""
        if saved_world == self.world:
            return consumed
        before = copy.copy(self)  # the same batches, cut for the saved world
        before.rank, before.world = 0, saved_world
        share = consumed * saved_world / max(len(before.all_batches(epoch)), 1)
        mine = len(self.all_batches(epoch)) // self.world
        return min(mine, round(share * mine))

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of padded positions (source and target) in an epoch's batches."""
        real = padded = 0
        for batch in self.all_batches(epoch):
            real += int(self.src_lens[batch].sum() + self.tgt_lens[batch].sum()) + 2 * len(batch)
            padded += len(batch) * int(self.src_lens[batch].max() + self.tgt_lens[batch].max() + 2)
        return 1.0 - real / padded if padded else 0.0
