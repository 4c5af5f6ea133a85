"""Datasets and the two loaders that feed a training step with static shapes.

Both loaders yield the same batches in the same order for a given seed, epoch and rank:
- ``DeviceLoader`` keeps the whole split on the accelerator. The epoch's index order
  lives in a device buffer and a device cursor picks each batch, so ``next_batch()``
  is pure device work that can sit inside a CUDA graph: the host pays nothing per step.
- ``HostLoader`` is for data that does not fit: a DataLoader gathers batches in pinned
  memory, ``stage()`` copies them (non_blocking) into static device buffers, and
  ``next_batch()`` hands those buffers to the step.
Training drops each rank's last partial batch; evaluation pads the last batch and
returns a ``mask`` so that every sample counts exactly once.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from trainer.errors import ConfigError
from trainer.recipe import Batch, Split
from trainer.runtime import Runtime


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


def plan_epoch(n: int, world: int, batch_size: int, batches_per_step: int, train: bool) -> Tuple[int, int]:
    """(steps per epoch, samples per epoch) for one rank."""
    if train:
        steps = check_batch_fits(n, world, batch_size * batches_per_step, "recipe.data")
        return steps, steps * batch_size * batches_per_step
    steps = math.ceil(math.ceil(n / world) / batch_size)  # the same count on every rank
    return steps, steps * batch_size


def epoch_index(n: int, length: int, rt: Runtime, *, train: bool, seed: int, epoch: int):
    """This rank's indices for one epoch padded to ``length``, and the mask of real samples."""
    idx = shard_indices(n, rt.rank, rt.world_size, shuffle=train, seed=seed, epoch=epoch)[:length]
    index = torch.zeros(length, dtype=torch.long)
    index[: len(idx)] = idx
    mask = torch.zeros(length, dtype=torch.bool)
    mask[: len(idx)] = True
    return index, mask


class DeviceLoader:
    """A split resident on ``device``; batches gathered on the device by a device cursor."""

    def __init__(self, split: Split, batch_size: int, rt: Runtime, *, train: bool, seed: int,
                 batches_per_step: int = 1):
        self.train, self.seed, self.rt, self.batch_size = train, seed, rt, batch_size
        self.batches_per_step = batches_per_step
        self.x = split.x.to(rt.device)
        self.y = split.y.to(rt.device)
        self.steps, self.length = plan_epoch(len(split), rt.world_size, batch_size, batches_per_step, train)
        self.index = torch.zeros(self.length, dtype=torch.long, device=rt.device)
        self.mask = torch.zeros(self.length, dtype=torch.bool, device=rt.device)
        self.cursor = torch.zeros((), dtype=torch.long, device=rt.device)
        self.offsets = torch.arange(batch_size, device=rt.device)
        self.start_epoch(0)

    def start_epoch(self, epoch: int) -> None:
        index, mask = epoch_index(len(self.y), self.length, self.rt, train=self.train, seed=self.seed, epoch=epoch)
        self.index.copy_(index)
        self.mask.copy_(mask)
        self.cursor.zero_()

    def skip(self, steps: int) -> None:
        """Moves past the first ``steps`` steps of the epoch (resuming mid-epoch)."""
        self.cursor.fill_(steps * self.batch_size * self.batches_per_step)

    def stage(self) -> None:
        """Nothing to do on the host: the batch is picked inside ``next_batch``."""

    def next_batch(self) -> Batch:
        pos = self.cursor + self.offsets
        idx = self.index.index_select(0, pos)
        self.cursor.add_(self.batch_size)
        batch = {"x": self.x.index_select(0, idx), "y": self.y.index_select(0, idx)}
        if not self.train:
            batch["mask"] = self.mask.index_select(0, pos)
        return batch


class _IndexedBatches(torch.utils.data.Dataset):
    def __init__(self, split: Split, index: torch.Tensor, mask: torch.Tensor, batch_size: int, train: bool):
        self.split, self.index, self.mask, self.batch_size, self.train = split, index, mask, batch_size, train

    def __len__(self) -> int:
        return len(self.index) // self.batch_size

    def __getitem__(self, i: int) -> Batch:
        sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
        idx = self.index[sl]
        batch = {"x": self.split.x[idx], "y": self.split.y[idx]}
        if not self.train:
            batch["mask"] = self.mask[sl]
        return batch


class HostLoader:
    """A DataLoader in host memory feeding static device buffers through pinned copies."""

    def __init__(self, split: Split, batch_size: int, rt: Runtime, *, train: bool, seed: int,
                 batches_per_step: int = 1, num_workers: int = 0):
        self.split, self.rt, self.train, self.seed = split, rt, train, seed
        self.batch_size, self.batches_per_step, self.num_workers = batch_size, batches_per_step, num_workers
        self.steps, self.length = plan_epoch(len(split), rt.world_size, batch_size, batches_per_step, train)
        rows = batch_size * batches_per_step if train else batch_size
        self.static: Batch = {
            "x": torch.empty((rows, *split.x.shape[1:]), dtype=split.x.dtype, device=rt.device),
            "y": torch.empty((rows, *split.y.shape[1:]), dtype=split.y.dtype, device=rt.device),
        }
        if not train:
            self.static["mask"] = torch.empty((rows,), dtype=torch.bool, device=rt.device)
        self._micro = 0
        self._it = None
        self.start_epoch(0)

    def start_epoch(self, epoch: int) -> None:
        index, mask = epoch_index(len(self.split), self.length, self.rt, train=self.train, seed=self.seed,
                                  epoch=epoch)
        per_load = self.batch_size * (self.batches_per_step if self.train else 1)
        ds = _IndexedBatches(self.split, index, mask, per_load, self.train)
        self._it = iter(torch.utils.data.DataLoader(
            ds, batch_size=None, shuffle=False, num_workers=self.num_workers,
            pin_memory=self.rt.device.type == "cuda", persistent_workers=False,
            generator=torch.Generator().manual_seed(self.seed + epoch)))  # leave the global RNG (dropout) alone

    def skip(self, steps: int) -> None:
        """Moves past the first ``steps`` steps of the epoch (resuming mid-epoch)."""
        for _ in range(steps if self.train else 0):
            next(self._it)

    def stage(self) -> None:
        batch = next(self._it)
        for k, v in batch.items():
            self.static[k].copy_(v, non_blocking=True)

    def next_batch(self) -> Batch:
        if not self.train or self.batches_per_step == 1:
            return self.static
        sl = slice(self._micro * self.batch_size, (self._micro + 1) * self.batch_size)
        self._micro = (self._micro + 1) % self.batches_per_step
        return {k: v[sl] for k, v in self.static.items()}


def make_loader(split: Split, batch_size: int, rt: Runtime, *, kind: str, train: bool, seed: int,
                batches_per_step: int = 1, num_workers: int = 0):
    if kind == "device":
        return DeviceLoader(split, batch_size, rt, train=train, seed=seed, batches_per_step=batches_per_step)
    return HostLoader(split, batch_size, rt, train=train, seed=seed,
                      batches_per_step=batches_per_step, num_workers=num_workers)
