"""How one epoch's samples become steps: the same plan on every rank and for both loaders.

A seeded permutation of the whole split per epoch, strided by rank. Training ends each epoch
with the samples that do not fill a whole step (unless ``recipe.data.drop_last``): one smaller
step, the tail, padded to the same rows on every rank and carrying a ``mask`` of its real
samples; evaluation pads its last batch the same way, so that every sample counts exactly once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from trainer.run.errors import ConfigError
from trainer.run.runtime import Runtime


def shard_indices(n: int, rank: int, world: int, *, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """This rank's sample indices for one epoch: a seeded global permutation, strided by rank."""
    if shuffle:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    return order[rank::world]


def check_batch_fits(n: int, world: int, samples_per_step: int, data_key: str) -> int:
    """Steps per epoch for one rank; a rank's shard must hold at least one full step."""
    shard = n // world
    steps = shard // samples_per_step
    if steps < 1:
        raise ConfigError(
            f"{data_key}.batch_size asks for {samples_per_step} samples per step on each rank, "
            f"but each of the {world} ranks has only {shard} training samples: "
            f"lower {data_key}.batch_size (or train.grad_accum)")
    return steps


@dataclass(frozen=True)
class StepShape:
    """The input rows of one training step on each rank: ``rows`` per micro-batch; a tail
    step is padded and masked, and ``real`` counts its real samples on all ranks together;
    ``seq_len``: a language model's sequence-length bucket (None: the whole window).
    Its ``str`` names the step's graph ("full", "tail48", "tail64+16", "full@T256")."""
    rows: Tuple[int, ...]
    tail: bool = False
    real: int = 0
    seq_len: Optional[int] = None

    def __str__(self) -> str:
        name = "tail" + "+".join(map(str, self.rows)) if self.tail else "full"
        return name if self.seq_len is None else f"{name}@T{self.seq_len}"


@dataclass(frozen=True)
class EpochShapes:
    """One rank's training epoch: ``full_steps`` steps of the ``full`` shape, then the ``tail`` if any."""
    full_steps: int
    full: StepShape
    tail: Optional[StepShape]

    @property
    def steps(self) -> int:
        return self.full_steps + (self.tail is not None)

    def at(self, i: int) -> StepShape:
        """The shape of the epoch's step ``i``."""
        return self.tail if self.tail is not None and i >= self.full_steps else self.full

    @property
    def tail_rows(self) -> int:
        return sum(self.tail.rows) if self.tail is not None else 0


def train_epoch_shapes(n: int, world: int, batch_size: int, batches_per_step: int, drop_last: bool) -> EpochShapes:
    """How ``n`` samples make one epoch of steps on ``world`` ranks.

    Full steps take ``batch_size`` x ``batches_per_step`` samples per rank. The rest (fewer
    than a full step on all ranks together), unless ``drop_last``, is the tail: one step whose
    samples are dealt to the ranks as evenly as they go, each rank's padded up to the most
    any rank has; with ``batches_per_step`` > 1 its rows are cut into micro-batches of at most
    ``batch_size`` (the last one smaller), so a tail step never needs more memory than a full one.
    """
    per_step = batch_size * batches_per_step
    full_steps = check_batch_fits(n, world, per_step, "recipe.data")
    full = StepShape((batch_size,) * batches_per_step)
    rest = n - full_steps * per_step * world
    if drop_last or rest == 0:
        return EpochShapes(full_steps, full, None)
    padded = math.ceil(rest / world)  # the most any rank has: its shard is at most one sample longer
    micro = [batch_size] * (padded // batch_size) + ([padded % batch_size] if padded % batch_size else [])
    return EpochShapes(full_steps, full, StepShape(tuple(micro), tail=True, real=rest))


def eval_epoch_size(n: int, world: int, batch_size: int) -> Tuple[int, int]:
    """(steps per evaluation, padded samples per rank): the same count on every rank."""
    steps = math.ceil(math.ceil(n / world) / batch_size)
    return steps, steps * batch_size


def _padded(indices: torch.Tensor, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``indices`` padded with zeros to ``length``, and the mask of the real ones."""
    index = torch.zeros(length, dtype=torch.long)
    index[: len(indices)] = indices
    mask = torch.zeros(length, dtype=torch.bool)
    mask[: len(indices)] = True
    return index, mask


def epoch_index(n: int, length: int, rt: Runtime, *, train: bool, seed: int, epoch: int):
    """This rank's indices for one epoch padded to ``length``, and the mask of real samples."""
    return _padded(shard_indices(n, rt.rank, rt.world_size, shuffle=train, seed=seed, epoch=epoch)[:length], length)


def train_epoch_index(n: int, shapes: EpochShapes, rt: Runtime, *, seed: int, epoch: int):
    """This rank's training indices for one epoch: (full steps' indices, the tail's indices
    padded to its rows, the tail's mask of real samples)."""
    shard = shard_indices(n, rt.rank, rt.world_size, shuffle=True, seed=seed, epoch=epoch)
    cut = shapes.full_steps * sum(shapes.full.rows)
    tail, mask = _padded(shard[cut:cut + shapes.tail_rows], shapes.tail_rows)
    return shard[:cut], tail, mask


def micro_slice(shape: StepShape, micro: int) -> slice:
    """The rows of micro-batch ``micro`` within its step's rows."""
    lo = sum(shape.rows[:micro])
    return slice(lo, lo + shape.rows[micro])
