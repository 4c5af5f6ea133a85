"""Gradient accumulation inside one step (one graph): micro-batches, with DDP's all-reduce only on the last.

    def train_step(model, x, y):                  # x, y: the whole batch of this rank
        optimizer.zero_grad(set_to_none=True)
        for x_micro, y_micro in graphing.micro_batches(model, 4, x, y):
            loss = F.cross_entropy(model(x_micro), y_micro) / 4   # 1/4: the gradient of the batch's mean loss
            loss.backward()                       # sums into .grad; DDP all-reduces after the last only
        optimizer.step()

Under DDP, ``model.no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``) is active while
each micro-batch but the last is yielded, so its
forward and backward (the loop body) add to the local ``.grad`` without communication; the last
backward all-reduces the sum once. A plain module (no ``no_sync``) gets the same micro-batches.

Loss scaling is yours to do, and it is stated here because it is easy to get wrong: backward
sums gradients over micro-batches, so divide each micro-batch's mean loss by their number
for the gradient of the whole batch's mean loss (equal micro-batches: ``micro_batches``
checks that the batch divides evenly). DDP then averages over ranks.

Graph-safe: the split makes views of the step's static inputs, and ``no_sync`` only flips a
Python flag that decides, while the step is captured, which backward passes carry DDP's
all-reduce; each replay then runs the same sequence.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Tuple, TypeVar

import torch

from graphing.sharded import sharded_units

T = TypeVar("T")


def no_sync_except_last(model: torch.nn.Module, items: Iterable[T]) -> Iterator[T]:
    """Yields each of ``items`` (your micro-batches, any kind), with gradient communication off
    while all but the last are yielded: DDP's ``model.no_sync()``, or for a model sharded with
    FSDP2's ``fully_shard``, ``set_requires_gradient_sync(False)`` (its unsharded gradients are
    kept between micro-batches, and reduce-scattered once, after the last)."""
    items = list(items)  # to know which one is last
    no_sync = getattr(model, "no_sync", None)
    if no_sync is None and len(items) > 1:  # FSDP2: the model, or its sharded root inside a wrapper (a compiled
        # model and loss); looked for only where there is a micro-batch to keep from syncing
        units = sharded_units(model)
        no_sync = _fsdp_no_sync(units[0]) if units else None
    for i, item in enumerate(items):
        last = i == len(items) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            yield item


def _fsdp_no_sync(model: torch.nn.Module):
    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return no_sync


def micro_batches(model: torch.nn.Module, count: int, *tensors: torch.Tensor
                  ) -> Iterator[Tuple[torch.Tensor, ...]]:
    """Splits each tensor along dim 0 into ``count`` equal micro-batches and yields them as tuples,
    with ``model.no_sync()`` active on all but the last (see ``no_sync_except_last``)."""
    if count < 1:
        raise ValueError(f"micro_batches: count={count} must be at least 1")
    for t in tensors:
        if t.shape[0] % count:
            raise ValueError(f"micro_batches: a batch of {t.shape[0]} does not split into {count} equal "
                             "micro-batches: make the batch a multiple of the count (a graph's shapes are fixed, "
                             "and unequal micro-batches would weigh their samples unequally)")
    split = [t.split(t.shape[0] // count) for t in tensors]
    return no_sync_except_last(model, zip(*split))
