"""The host loader: any map-style dataset (images on disk, a memory-mapped token file)
through DataLoader workers, for data too large to keep on the device.

``stage()`` takes the next batch, copies it into one of two pinned buffers and from there
(``non_blocking``) into the step's static device buffers; ``next_batch()`` hands those buffers
to the step. Pinning in the loop's own thread, into buffers made once, keeps other threads from
calling CUDA while a graph is captured, so the default ``capture_error_mode=global`` holds.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from trainer.data.epochs import (
    StepShape, epoch_index, micro_slice, eval_epoch_size, train_epoch_shapes, train_epoch_index,
)
from trainer.data.items import BatchReader, EpochRows, draws_per_epoch, keep_batch, sample_item
from trainer.data.workers import batches, end_workers, worker_options
from trainer.recipe import PADDING_MASK, Batch, SplitLike
from trainer.run.runtime import Runtime


Rows = Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]  # an epoch's rows of indices, each row's mask


class _EpochRows:
    """This rank's rows of dataset indices for an epoch, and each row's mask of real samples (None: all real),
    for the loader and its sampler alike; the sampler asks for the next epoch's while the loop still reads this
    one's, so the last two are kept. An object of its own so that the sampler (which the DataLoader holds) never
    refers back to the HostLoader: in such a cycle an unclosed loader is freed only by the garbage collector,
    whose order of teardown left DataLoader's shutdown waiting 5 s on each worker."""

    def __init__(self, size: int, shapes, length: Optional[int], rows_per_load: int, rt: Runtime, *, train: bool,
                 seed: int):
        self.size, self.shapes, self.length, self.rows_per_load = size, shapes, length, rows_per_load
        self.rt, self.train, self.seed = rt, train, seed
        self._cache: Dict[int, Rows] = {}

    def __call__(self, epoch: int) -> Rows:
        if epoch not in self._cache:
            if self.train:
                full, tail, tail_mask = train_epoch_index(self.size, self.shapes, self.rt, seed=self.seed, epoch=epoch)
                rows = list(full.view(-1, self.rows_per_load))
                masks = [None] * len(rows)  # full rows: every sample is real
                if self.shapes.tail is not None:
                    rows.append(tail)
                    masks.append(tail_mask)
            else:
                index, mask = epoch_index(self.size, self.length, self.rt, train=False, seed=self.seed, epoch=epoch)
                rows, masks = list(index.view(-1, self.rows_per_load)), list(mask.view(-1, self.rows_per_load))
            self._cache = {e: v for e, v in self._cache.items() if e >= epoch - 1}  # the loop's and the next
            self._cache[epoch] = (rows, masks)
        return self._cache[epoch]


class _EpochBatches:
    """The batch sampler: this rank's rows of dataset indices from (``epoch``, ``start``) on; each row goes with
    its epoch to a dataset that draws its items per epoch (``draws_per_epoch``). ``continuous`` (training): at an
    epoch's end it goes on into the next epoch's rows, so the workers read ahead across the boundary instead of
    starting empty there (a whole batch's decoding, seconds for large photos, once per epoch)."""

    def __init__(self, epoch_rows: _EpochRows, with_epoch: bool, continuous: bool):
        self.epoch_rows, self.with_epoch, self.continuous = epoch_rows, with_epoch, continuous
        self.epoch = 0
        self.start = 0

    def __iter__(self):
        epoch, start = self.epoch, self.start
        while True:
            rows = self.epoch_rows(epoch)[0]
            for r in range(start, len(rows)):
                yield EpochRows(epoch, rows[r].tolist()) if self.with_epoch else rows[r].tolist()
            if not self.continuous:
                return
            epoch, start = epoch + 1, 0


class HostLoader:
    """Any map-style dataset through DataLoader workers, into static device buffers."""

    def __init__(self, dataset: SplitLike, batch_size: int, rt: Runtime, *, train: bool, seed: int,
                 batches_per_step: int = 1, num_workers: int = 0, prefetch_factor: int = 4, drop_last: bool = False):
        self.dataset, self.rt, self.train, self.seed = dataset, rt, train, seed
        self.batch_size, self.batches_per_step, self.num_workers = batch_size, batches_per_step, num_workers
        if train:
            self.shapes = train_epoch_shapes(len(dataset), rt.world_size, batch_size, batches_per_step, drop_last)
            self.steps = self.shapes.steps
        else:
            self.shapes = None
            self.steps, self.length = eval_epoch_size(len(dataset), rt.world_size, batch_size)
        self.rows_per_load = batch_size * batches_per_step if train else batch_size
        shapes = {name: ((self.rows_per_load, *value.shape), value.dtype)
                  for name, value in sample_item(dataset).items()}
        shapes[PADDING_MASK] = ((self.rows_per_load,), torch.bool)  # training: the tail's real samples
        self.static: Batch = {k: torch.empty(s, dtype=d, device=rt.device) for k, (s, d) in shapes.items()}
        pin = rt.device.type == "cuda"
        # Two pinned buffers: the host fills one while the other's copy may still be in flight.
        self.pinned = [{k: torch.empty(s, dtype=d, pin_memory=pin) for k, (s, d) in shapes.items()}
                       for _ in range(2 if pin else 0)]
        self.copied = [torch.cuda.Event() if pin else None for _ in self.pinned]
        self._slot = 0
        self.epoch_rows = _EpochRows(len(dataset), self.shapes, None if train else self.length, self.rows_per_load,
                                     rt, train=train, seed=seed)
        self.sampler = _EpochBatches(self.epoch_rows, with_epoch=draws_per_epoch(dataset), continuous=train)
        self.masks: List[Optional[torch.Tensor]] = []  # per row of the epoch: its real samples (None: all)
        self.loader = torch.utils.data.DataLoader(
            BatchReader(dataset), batch_sampler=self.sampler, collate_fn=keep_batch, **worker_options(num_workers, dataset),
            persistent_workers=num_workers > 0, prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=False,  # pinned here, in the loop's thread (see the module docstring)
            generator=torch.Generator().manual_seed(seed))  # its worker seeds must not draw from the global RNG
        self._micro = 0
        self._it = None
        self._epoch = 0
        self._next = None  # (epoch, row) of the batch the iterator delivers next
        self.waited_s = 0.0  # time stage() spent waiting for a batch from the workers
        self.start_epoch(0)

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._begin(0)

    def skip(self, steps: int) -> None:
        """Starts the epoch at step ``steps`` (resuming mid-epoch): the skipped batches are never read."""
        self._begin(steps if self.train else 0)

    def _begin(self, row: int) -> None:
        self.masks = self.epoch_rows(self._epoch)[1]
        self._row = row
        self._micro = 0
        if self._it is not None and self._next == (self._epoch, row):
            return  # the next epoch's start, which the workers are already reading: no restart
        self.sampler.epoch, self.sampler.start = self._epoch, row
        self._it = None  # made at the first stage(): start_epoch then skip starts the workers once

    def stage(self) -> None:
        if self._it is None:
            self._it = batches(self.loader, iter(self.loader), what=f"{type(self.dataset).__name__} "
                               f"({'training' if self.train else 'evaluation'})")
        began = time.perf_counter()
        batch = dict(next(self._it))
        self.waited_s += time.perf_counter() - began  # the loop waiting for its workers
        mask = self.masks[self._row]
        if mask is not None:
            batch[PADDING_MASK] = mask
        self._row += 1
        self._next = (self._epoch, self._row) if self._row < len(self.masks) else (self._epoch + 1, 0)
        rows = len(batch["x"])  # a tail row is shorter: it fills the buffers' first rows
        if not self.pinned:  # CPU training: the batch is already where the step reads it
            for k, v in batch.items():
                host_copy(self.static[k][:rows], v)
            return
        slot, done = self.pinned[self._slot], self.copied[self._slot]
        done.synchronize()  # this buffer's previous copy to the device has finished
        for k, v in batch.items():
            host_copy(slot[k][:rows], v)
            self.static[k][:rows].copy_(slot[k][:rows], non_blocking=True)
        done.record()
        self._slot ^= 1

    def close(self) -> None:
        """Ends the worker processes now (persistent workers would otherwise live until exit)."""
        end_workers(getattr(self.loader, "_iterator", None))  # persistent workers: the loader keeps one iterator
        self.loader._iterator = self._it = None

    def next_batch(self) -> Batch:
        if not self.train:
            return self.static
        fields = {k: v for k, v in self.static.items() if k != PADDING_MASK}
        if self.batches_per_step == 1:
            return fields
        sl = slice(self._micro * self.batch_size, (self._micro + 1) * self.batch_size)
        self._micro = (self._micro + 1) % self.batches_per_step
        return {k: v[sl] for k, v in fields.items()}

    def tail_batch(self, shape: StepShape, micro: int) -> Batch:
        """Micro-batch ``micro`` of the epoch's tail step (the first rows of the buffers), with its mask."""
        rows = micro_slice(shape, micro)
        return {k: v[rows] for k, v in self.static.items()}


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A host-to-host copy on this thread alone. torch's own copy_ spreads a large copy over
    its intra-op threads, which then wait on cores the DataLoader workers keep busy: measured
    at 0.9 ms instead of 0.03 ms per batch with two workers on two cores."""
    try:
        np.copyto(dst.numpy(), src.numpy())
    except TypeError:  # a dtype numpy lacks (bfloat16)
        dst.copy_(src)
