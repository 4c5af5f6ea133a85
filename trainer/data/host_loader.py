"""The two loaders that feed a training step with static shapes.

Both loaders yield the same batches in the same order for a given seed, epoch and rank
(a seeded permutation of the whole split per epoch, strided by rank):
- ``DeviceLoader`` keeps the whole split on the accelerator. The epoch's index order
  lives in a device buffer and a device cursor picks each batch, so ``next_batch()``
  is pure device work that can sit inside a CUDA graph: the host pays nothing per step.
- ``HostLoader`` reads any map-style Dataset (images on disk, a memory-mapped token
  file) through DataLoader workers. ``stage()`` takes the next batch, copies it into
  one of two pinned buffers and from there (``non_blocking``) into the step's static
  device buffers; ``next_batch()`` hands those buffers to the step. Pinning in the
  loop's own thread, into buffers made once, keeps other threads from calling CUDA
  while a graph is captured, so the default ``capture_error_mode=global`` holds.
Training ends each epoch with the samples that do not fill a whole step (unless
``recipe.data.drop_last``): one smaller step, the tail, padded to the same rows on every
rank and carrying a ``mask`` of its real samples (``StepLayout``, ``EpochPlan``).
Evaluation pads the last batch the same way, so that every sample counts exactly once. Resuming mid-epoch starts
the epoch's sampler at the exact batch; nothing before it is read. Both carry every field
of the dataset's items: ``x``, ``y`` and, for a model with several inputs, the others by
name (trainer/recipe.py, ``SplitLike``); ``item_problem`` checks item 0 against that once.
"""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from trainer.errors import ConfigError
from trainer.recipe import PADDING_MASK, Batch, Split, SplitLike
from trainer.runtime import Runtime

DEVICE_MEMORY_SHARE = 0.3  # loader=auto keeps a split on the device when it takes at most this share of free memory


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
class StepLayout:
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
class EpochPlan:
    """One rank's training epoch: ``full_steps`` steps of ``full`` layout, then the ``tail`` if any."""
    full_steps: int
    full: StepLayout
    tail: Optional[StepLayout]

    @property
    def steps(self) -> int:
        return self.full_steps + (self.tail is not None)

    def layout(self, i: int) -> StepLayout:
        """The layout of the epoch's step ``i``."""
        return self.tail if self.tail is not None and i >= self.full_steps else self.full

    @property
    def tail_rows(self) -> int:
        return sum(self.tail.rows) if self.tail is not None else 0


def plan_train_epoch(n: int, world: int, batch_size: int, batches_per_step: int, drop_last: bool) -> EpochPlan:
    """How ``n`` samples make one epoch of steps on ``world`` ranks.

    Full steps take ``batch_size`` x ``batches_per_step`` samples per rank. The rest (fewer
    than a full step on all ranks together), unless ``drop_last``, is the tail: one step whose
    samples are dealt to the ranks as evenly as they go, each rank's padded up to the most
    any rank has; with ``batches_per_step`` > 1 its rows are cut into micro-batches of at most
    ``batch_size`` (the last one smaller), so a tail step never needs more memory than a full one.
    """
    per_step = batch_size * batches_per_step
    full_steps = check_batch_fits(n, world, per_step, "recipe.data")
    full = StepLayout((batch_size,) * batches_per_step)
    rest = n - full_steps * per_step * world
    if drop_last or rest == 0:
        return EpochPlan(full_steps, full, None)
    padded = math.ceil(rest / world)  # the most any rank has: its shard is at most one sample longer
    micro = [batch_size] * (padded // batch_size) + ([padded % batch_size] if padded % batch_size else [])
    return EpochPlan(full_steps, full, StepLayout(tuple(micro), tail=True, real=rest))


def plan_eval_epoch(n: int, world: int, batch_size: int) -> Tuple[int, int]:
    """(steps per evaluation, padded samples per rank): the same count on every rank."""
    steps = math.ceil(math.ceil(n / world) / batch_size)
    return steps, steps * batch_size


def epoch_index(n: int, length: int, rt: Runtime, *, train: bool, seed: int, epoch: int):
    """This rank's indices for one epoch padded to ``length``, and the mask of real samples."""
    idx = shard_indices(n, rt.rank, rt.world_size, shuffle=train, seed=seed, epoch=epoch)[:length]
    index = torch.zeros(length, dtype=torch.long)
    index[: len(idx)] = idx
    mask = torch.zeros(length, dtype=torch.bool)
    mask[: len(idx)] = True
    return index, mask


def train_epoch_index(n: int, plan: EpochPlan, rt: Runtime, *, seed: int, epoch: int):
    """This rank's training indices for one epoch: (full steps' indices, the tail's indices
    padded to its rows, the tail's mask of real samples)."""
    shard = shard_indices(n, rt.rank, rt.world_size, shuffle=True, seed=seed, epoch=epoch)
    cut = plan.full_steps * sum(plan.full.rows)
    rest = shard[cut:cut + plan.tail_rows]
    tail = torch.zeros(plan.tail_rows, dtype=torch.long)
    tail[: len(rest)] = rest
    mask = torch.zeros(plan.tail_rows, dtype=torch.bool)
    mask[: len(rest)] = True
    return shard[:cut], tail, mask


def micro_slice(layout: StepLayout, micro: int) -> slice:
    """The rows of micro-batch ``micro`` within its step's rows."""
    lo = sum(layout.rows[:micro])
    return slice(lo, lo + layout.rows[micro])


class DeviceLoader:
    """A split resident on ``device``; batches gathered on the device by a device cursor."""

    def __init__(self, split: Split, batch_size: int, rt: Runtime, *, train: bool, seed: int,
                 batches_per_step: int = 1, drop_last: bool = False):
        self.train, self.seed, self.rt, self.batch_size = train, seed, rt, batch_size
        self.batches_per_step = batches_per_step
        self.fields = {name: values.to(rt.device) for name, values in split.fields().items()}
        self.n = len(split)
        if train:
            self.plan = plan_train_epoch(self.n, rt.world_size, batch_size, batches_per_step, drop_last)
            self.steps, length = self.plan.steps, self.plan.full_steps * batch_size * batches_per_step
            # The tail's indices and mask: read by static slices inside the tail step's graph.
            self.tail_index = torch.zeros(self.plan.tail_rows, dtype=torch.long, device=rt.device)
            self.tail_mask = torch.zeros(self.plan.tail_rows, dtype=torch.bool, device=rt.device)
        else:
            self.plan = None
            self.steps, length = plan_eval_epoch(self.n, rt.world_size, batch_size)
        # The epoch's indices as rows of one micro-batch; the cursor is the row to read next.
        self.rows = torch.zeros(length // batch_size, batch_size, dtype=torch.long, device=rt.device)
        self.mask_rows = torch.zeros(length // batch_size, batch_size, dtype=torch.bool, device=rt.device)
        self.cursor = torch.zeros(1, dtype=torch.long, device=rt.device)
        self.start_epoch(0)

    def start_epoch(self, epoch: int) -> None:
        if self.train:
            full, tail, tail_mask = train_epoch_index(self.n, self.plan, self.rt, seed=self.seed, epoch=epoch)
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

    def tail_batch(self, layout: StepLayout, micro: int) -> Batch:
        """Micro-batch ``micro`` of the epoch's tail step, with its mask of real samples."""
        rows = micro_slice(layout, micro)
        batch = {name: values.index_select(0, self.tail_index[rows]) for name, values in self.fields.items()}
        batch[PADDING_MASK] = self.tail_mask[rows]
        return batch


def item_fields(item) -> Mapping[str, Any]:
    """A dataset item by field: ``(x, y)`` as {"x", "y"}; a dict as it is (item 0 was checked)."""
    if isinstance(item, Mapping):
        return item
    x, y = item
    return {"x": x, "y": y}


def item_problem(dataset: SplitLike) -> Optional[str]:
    """What makes ``dataset``'s items unfit for the loaders (the contract: trainer/recipe.py,
    ``SplitLike``), judged on item 0; None when they fit."""
    if isinstance(dataset, Split):
        fields = dataset.fields()
        for name, values in fields.items():  # "x" first: its length is the split's
            if not torch.is_tensor(values):
                return f"the Split's {name!r} is a {type(values).__name__}, not a tensor"
            if values.dim() == 0:
                return f"the Split's {name!r} is a scalar, not one value per sample"
            if len(values) != len(dataset.x):
                return f"the Split has {len(dataset.x)} samples in 'x' but {len(values)} in {name!r}"
    elif len(dataset) == 0:
        return None  # sample_item names an empty dataset, with the settings that size it
    else:
        item = dataset[0]
        if isinstance(item, Mapping):
            missing = [f"{name!r}" for name in ("x", "y") if name not in item]
            if missing:
                return f"item 0 is a dict without {' and '.join(missing)} (it has {', '.join(map(repr, item))})"
            fields = dict(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            fields = {"x": item[0], "y": item[1]}
        elif isinstance(item, (tuple, list)):
            return f"item 0 is a {type(item).__name__} of {len(item)} values"
        else:
            return f"item 0 is a {type(item).__name__}, not a pair (x, y)"
    if PADDING_MASK in fields:
        return (f"a field is named {PADDING_MASK!r}, the trainer's own name (evaluation's padding mask): name it "
                "otherwise (attention_mask, ...) in the dataset and in Recipe.forward")
    for name, value in fields.items():
        if not isinstance(name, str):
            return f"a field is named {name!r}: name each field with a string"
        try:
            torch.as_tensor(value)
        except Exception:  # what collate would meet: a file path, None, an object torch cannot read
            return f"item 0's {name!r} is a {type(value).__module__}.{type(value).__name__}, not a tensor"
    return None


def extra_input_names(dataset: SplitLike) -> List[str]:
    """The fields of ``dataset``'s items besides "x" and "y" (judged on item 0): inputs for Recipe.forward."""
    if isinstance(dataset, Split):
        names = list(dataset.fields())
    elif len(dataset) == 0 or not isinstance(dataset[0], Mapping):
        return []
    else:
        names = list(dataset[0])
    return [name for name in names if name not in ("x", "y")]


def collate(items: Sequence) -> Batch:
    """Stacks dataset items (``(x, y)`` or dicts of fields) into batch tensors by field;
    unequal samples are named."""
    rows = [item_fields(item) for item in items]
    batch: Batch = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if name == "y":
            y = torch.stack([torch.as_tensor(v) for v in values]) if torch.is_tensor(values[0]) \
                else torch.as_tensor(values)
            batch["y"] = y.long() if not y.is_floating_point() else y
            continue
        tensors = [torch.as_tensor(v) for v in values]
        first = tensors[0]
        for i, t in enumerate(tensors):
            if t.shape != first.shape or t.dtype != first.dtype:
                what = "samples" if name == "x" else f"{name!r} fields"
                raise ConfigError(f"the dataset's {what} differ: one is {tuple(first.shape)} {first.dtype}, "
                                  f"another {tuple(t.shape)} {t.dtype} (batch position {i}); a graphed step needs "
                                  "every sample of one shape and dtype: resize or pad them in the dataset")
        batch[name] = torch.stack(tensors)
    return batch


class BatchReader(torch.utils.data.Dataset):
    """Reads whole batches of a dataset by index list (what DataLoader workers run).

    A ``Split`` is gathered with one tensor index; any other dataset item by item, or
    through its own ``__getitems__`` when it has one.
    """

    def __init__(self, dataset: SplitLike):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: List[int]) -> Batch:
        ds = self.dataset
        if isinstance(ds, Split):
            idx = torch.as_tensor(indices)
            return {name: values[idx] for name, values in ds.fields().items()}
        items = ds.__getitems__(indices) if hasattr(ds, "__getitems__") else [ds[i] for i in indices]
        return collate(items)


def _keep(batch):
    return batch  # BatchReader already made the batch (a module-level function: workers pickle it)


def _worker_init(_worker_id: int) -> None:
    """Workers fork from a process that blocks SIGINT/SIGTERM for its signal thread
    (trainer/stop.py); unblocked here, so that shutting a worker down can end it."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


class _EpochBatches:
    """The batch sampler: this rank's epoch as rows of dataset indices, from a start row."""

    def __init__(self):
        self.rows: List[torch.Tensor] = []
        self.start = 0

    def __iter__(self):
        for r in range(self.start, len(self.rows)):
            yield self.rows[r].tolist()

    def __len__(self) -> int:
        return len(self.rows) - self.start


class HostLoader:
    """Any map-style dataset through DataLoader workers, into static device buffers."""

    def __init__(self, dataset: SplitLike, batch_size: int, rt: Runtime, *, train: bool, seed: int,
                 batches_per_step: int = 1, num_workers: int = 0, prefetch_factor: int = 4, drop_last: bool = False):
        self.dataset, self.rt, self.train, self.seed = dataset, rt, train, seed
        self.batch_size, self.batches_per_step, self.num_workers = batch_size, batches_per_step, num_workers
        if train:
            self.plan = plan_train_epoch(len(dataset), rt.world_size, batch_size, batches_per_step, drop_last)
            self.steps = self.plan.steps
        else:
            self.plan = None
            self.steps, self.length = plan_eval_epoch(len(dataset), rt.world_size, batch_size)
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
        self.sampler = _EpochBatches()
        self.masks: List[torch.Tensor] = []  # per row of the sampler: its real samples
        self.loader = torch.utils.data.DataLoader(
            BatchReader(dataset), batch_sampler=self.sampler, collate_fn=_keep, num_workers=num_workers,
            persistent_workers=num_workers > 0, prefetch_factor=prefetch_factor if num_workers > 0 else None,
            worker_init_fn=_worker_init if num_workers > 0 else None,
            pin_memory=False,  # pinned here, in the loop's thread (see the module docstring)
            generator=torch.Generator().manual_seed(seed))  # its worker seeds must not draw from the global RNG
        self._micro = 0
        self._it = None
        self.waited_s = 0.0  # time stage() spent waiting for a batch from the workers
        self.start_epoch(0)

    def start_epoch(self, epoch: int) -> None:
        if self.train:
            full, tail, tail_mask = train_epoch_index(len(self.dataset), self.plan, self.rt, seed=self.seed,
                                                      epoch=epoch)
            rows = list(full.view(-1, self.rows_per_load))
            self.masks = [None] * len(rows)  # full rows: every sample is real
            if self.plan.tail is not None:
                rows.append(tail)
                self.masks.append(tail_mask)
        else:
            index, mask = epoch_index(len(self.dataset), self.length, self.rt, train=False, seed=self.seed,
                                      epoch=epoch)
            rows, self.masks = list(index.view(-1, self.rows_per_load)), list(mask.view(-1, self.rows_per_load))
        self.sampler.rows = rows
        self._begin(0)

    def skip(self, steps: int) -> None:
        """Starts the epoch at step ``steps`` (resuming mid-epoch): the skipped batches are never read."""
        self._begin(steps if self.train else 0)

    def _begin(self, row: int) -> None:
        self.sampler.start = row
        self._row = row
        self._micro = 0
        self._it = None  # made at the first stage(): start_epoch then skip starts the workers once

    def stage(self) -> None:
        if self._it is None:
            self._it = iter(self.loader)
        began = time.perf_counter()
        batch = dict(next(self._it))
        self.waited_s += time.perf_counter() - began  # the loop waiting for its workers
        mask = self.masks[self._row]
        if mask is not None:
            batch[PADDING_MASK] = mask
        self._row += 1
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
        iterator = getattr(self.loader, "_iterator", None)  # persistent workers: the loader keeps one iterator
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
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

    def tail_batch(self, layout: StepLayout, micro: int) -> Batch:
        """Micro-batch ``micro`` of the epoch's tail step (the first rows of the buffers), with its mask."""
        rows = micro_slice(layout, micro)
        return {k: v[rows] for k, v in self.static.items()}


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A host-to-host copy on this thread alone. torch's own copy_ spreads a large copy over
    its intra-op threads, which then wait on cores the DataLoader workers keep busy: measured
    at 0.9 ms instead of 0.03 ms per batch with two workers on two cores."""
    try:
        np.copyto(dst.numpy(), src.numpy())
    except TypeError:  # a dtype numpy lacks (bfloat16)
        dst.copy_(src)


def sample_item(dataset: SplitLike) -> Dict[str, torch.Tensor]:
    """Item 0 as tensors by field: the shape and dtype of every sample."""
    if len(dataset) == 0:
        raise ConfigError("the recipe's dataset is empty: check recipe.data.root and recipe.data.train_size")
    if isinstance(dataset, Split):
        return {name: values[0] for name, values in dataset.fields().items()}
    return {name: values[0] for name, values in collate([dataset[0]]).items()}


def split_bytes(dataset: SplitLike) -> int:
    return len(dataset) * sum(v.numel() * v.element_size() for v in sample_item(dataset).values())


def read_every_item(dataset: SplitLike, num_workers: int, batch: int = 512) -> Split:
    """Every item of ``dataset`` read once, ``batch`` at a time by ``num_workers`` processes
    (none for a dataset of one batch), stacked into one ``Split`` in item order."""
    loader = torch.utils.data.DataLoader(
        BatchReader(dataset), collate_fn=_keep, num_workers=num_workers if len(dataset) > batch else 0,
        generator=torch.Generator(),  # leaves the global RNG (dropout) alone
        batch_sampler=[list(range(i, min(i + batch, len(dataset)))) for i in range(0, len(dataset), batch)])
    batches = list(loader)
    fields = {name: torch.cat([b[name] for b in batches]) for name in batches[0]}
    return Split(fields.pop("x"), fields.pop("y"), fields)


def read_all(dataset: SplitLike, num_workers: int) -> Split:
    """The whole dataset as one ``Split``: its own ``to_split()``, or every item read once."""
    if isinstance(dataset, Split):
        return dataset
    if hasattr(dataset, "to_split"):
        return dataset.to_split()
    return read_every_item(dataset, num_workers)


def fits_on_device(nbytes: int, device: torch.device) -> bool:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 2**33
    return nbytes <= DEVICE_MEMORY_SHARE * free


def choose_loader(kind: str, train: SplitLike, test: SplitLike, device: torch.device) -> str:
    """``device`` or ``host`` for ``recipe.data.loader`` (auto: device when both splits fit)."""
    if kind == "host":
        return kind
    nbytes = split_bytes(train) + split_bytes(test)
    if fits_on_device(nbytes, device):
        return "device"
    if kind == "auto":
        return "host"
    raise ConfigError(f"the data takes {nbytes / 2**30:.1f} GiB, more than {DEVICE_MEMORY_SHARE:.0%} of the "
                      f"{device.type} memory that is free: set recipe.data.loader=host (or auto) to stream it "
                      "through DataLoader workers")


def make_loader(dataset: SplitLike, batch_size: int, rt: Runtime, *, kind: str, train: bool, seed: int,
                batches_per_step: int = 1, num_workers: int = 0, drop_last: bool = False):
    """A loader of ``kind`` (``device`` or ``host``, as ``choose_loader`` decided)."""
    if kind == "device":
        return DeviceLoader(read_all(dataset, num_workers), batch_size, rt, train=train, seed=seed,
                            batches_per_step=batches_per_step, drop_last=drop_last)
    return HostLoader(dataset, batch_size, rt, train=train, seed=seed,
                      batches_per_step=batches_per_step, num_workers=num_workers, drop_last=drop_last)
