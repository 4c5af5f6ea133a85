"""The device loader: the whole split kept on the accelerator, for data that fits there.

The epoch's index order lives in a device buffer and a device cursor picks each batch, so
``next_batch()`` is pure device work that can sit inside a CUDA graph: the host pays nothing
per step.
"""
from __future__ import annotations

import torch

from trainer.data.epochs import (
    StepShape, epoch_index, micro_slice, eval_epoch_size, train_epoch_shapes, train_epoch_index,
)
from trainer.recipe import PADDING_MASK, Batch, Split
from trainer.run.runtime import Runtime


class DeviceLoader:
    """A split resident on ``device``; batches gathered on the device by a device cursor."""

    def __init__(self, split: Split, batch_size: int, rt: Runtime, *, train: bool, seed: int,
                 batches_per_step: int = 1, drop_last: bool = False):
        self.train, self.seed, self.rt, self.batch_size = train, seed, rt, batch_size
        self.batches_per_step = batches_per_step
        self.waited_s = 0.0  # as the host loader's: nothing to wait for here, the batches are gathered on the device
        self.fields = {name: values.to(rt.device) for name, values in split.fields().items()}
        self.n = len(split)
        if train:
            self.shapes = train_epoch_shapes(self.n, rt.world_size, batch_size, batches_per_step, drop_last)
            self.steps, length = self.shapes.steps, self.shapes.full_steps * batch_size * batches_per_step
            # The tail's indices and mask: read by static slices inside the tail step's graph.
            self.tail_index = torch.zeros(self.shapes.tail_rows, dtype=torch.long, device=rt.device)
            self.tail_mask = torch.zeros(self.shapes.tail_rows, dtype=torch.bool, device=rt.device)
        else:
            self.shapes = None
            self.steps, length = eval_epoch_size(self.n, rt.world_size, batch_size)
        # The epoch's indices as rows of one micro-batch; the cursor is the row to read next.
        self.rows = torch.zeros(length // batch_size, batch_size, dtype=torch.long, device=rt.device)
        self.mask_rows = torch.zeros(length // batch_size, batch_size, dtype=torch.bool, device=rt.device)
        self.cursor = torch.zeros(1, dtype=torch.long, device=rt.device)
        self.start_epoch(0)

    def start_epoch(self, epoch: int) -> None:
        if self.train:
            full, tail, tail_mask = train_epoch_index(self.n, self.shapes, self.rt, seed=self.seed, epoch=epoch)
            self.rows.copy_(full.view_as(self.rows))
            self.tail_index.copy_(tail)
            self.tail_mask.copy_(tail_mask)
        else:
            index, mask = epoch_index(self.n, self.rows.numel(), self.rt, train=False, seed=self.seed, epoch=epoch)
            self.rows.copy_(index.view_as(self.rows))
            self.mask_rows.copy_(mask.view_as(self.mask_rows))
        self.cursor.zero_()

    def skip(self, steps: int) -> None:
        """Moves past the first ``steps`` steps of the epoch (resuming mid-epoch)."""
        self.cursor.fill_(steps * self.batches_per_step)

    def stage(self) -> None:
        """Nothing to do on the host: the batch is picked inside ``next_batch``."""

    def close(self) -> None:
        """Nothing to release."""

    def next_batch(self) -> Batch:
        # Small kernels inside the graph: the row of indices, one gather per field (two for
        # (x, y)), the cursor.
        idx = self.rows.index_select(0, self.cursor).view(-1)
        batch = {name: values.index_select(0, idx) for name, values in self.fields.items()}
        if not self.train:
            batch[PADDING_MASK] = self.mask_rows.index_select(0, self.cursor).view(-1)
        self.cursor.add_(1)
        return batch

    def tail_batch(self, shape: StepShape, micro: int) -> Batch:
        """Micro-batch ``micro`` of the epoch's tail step, with its mask of real samples."""
        rows = micro_slice(shape, micro)
        batch = {name: values.index_select(0, self.tail_index[rows]) for name, values in self.fields.items()}
        batch[PADDING_MASK] = self.tail_mask[rows]
        return batch
