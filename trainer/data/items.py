"""What the loaders take from a dataset, and how its items become batches.

Items are ``(x, y)`` or dicts of fields: ``x``, ``y`` and, for a model with several inputs,
the others by name (the contract: trainer/recipe.py, ``SplitLike``). ``item_problem`` checks
item 0 against it once, so that a dataset that does not fit says why before a loader meets it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from trainer.data.workers import batches, end_workers, worker_options
from trainer.run.errors import ConfigError
from trainer.recipe import PADDING_MASK, Batch, Split, SplitLike


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
        batch[name] = torch.stack(tensors, out=_shared_output(first, len(tensors)))
    return batch


def _shared_output(sample: torch.Tensor, rows: int) -> Optional[torch.Tensor]:
    """In a DataLoader worker, a [rows, *sample.shape] tensor in shared memory to stack the batch into, as torch's
    default_collate does: a batch stacked into ordinary memory is copied into shared memory again when the worker
    sends it (20 of 45 ms per batch of 256 224-pixel crops, measured on the CPU). None elsewhere: stack as usual."""
    if torch.utils.data.get_worker_info() is None:
        return None
    storage = sample.untyped_storage()._new_shared(rows * sample.numel() * sample.element_size())
    return sample.new(storage).resize_(rows, *sample.shape)


class EpochRows(NamedTuple):
    """A batch request that carries its epoch: for a dataset whose items change with it (``set_epoch``)."""
    epoch: int
    indices: List[int]


class BatchReader(torch.utils.data.Dataset):
    """Reads whole batches of a dataset by index list (what DataLoader workers run).

    A ``Split`` is gathered with one tensor index; any other dataset item by item, or
    through its own ``__getitems__`` when it has one. A request of ``EpochRows`` first tells
    the dataset its epoch (``set_epoch``), here in the process that reads: a persistent
    worker's copy of the dataset then never lags the loader's epoch.
    """

    def __init__(self, dataset: SplitLike):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: Union[List[int], EpochRows]) -> Batch:
        ds = self.dataset
        if isinstance(indices, EpochRows):
            drawing = epoch_drawing(ds)
            if drawing is not None:
                drawing.set_epoch(indices.epoch)
            indices = indices.indices
        if isinstance(ds, Split):
            idx = torch.as_tensor(indices)
            return {name: values[idx] for name, values in ds.fields().items()}
        items = ds.__getitems__(indices) if hasattr(ds, "__getitems__") else [ds[i] for i in indices]
        return collate(items)


def epoch_drawing(dataset: SplitLike):
    """The dataset (``dataset`` itself, or what a ``torch.utils.data.Subset`` of it wraps) whose items change with
    the epoch (random crops drawn per epoch): it has ``set_epoch(epoch)``, as torch's DistributedSampler does;
    None where there is none."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    return dataset if callable(getattr(dataset, "set_epoch", None)) else None


def draws_per_epoch(dataset: SplitLike) -> bool:
    """Whether ``dataset``'s items change with the epoch (``epoch_drawing``). Only the host loader serves it."""
    return epoch_drawing(dataset) is not None


def keep_batch(batch):
    return batch  # BatchReader already made the batch (a module-level function: workers pickle it)


def sample_item(dataset: SplitLike) -> Dict[str, torch.Tensor]:
    """Item 0 as tensors by field: the shape and dtype of every sample."""
    if len(dataset) == 0:
        raise ConfigError("the recipe's dataset is empty: check recipe.data.root and recipe.data.train_size")
    if isinstance(dataset, Split):
        return {name: values[0] for name, values in dataset.fields().items()}
    return {name: values[0] for name, values in collate([dataset[0]]).items()}


def read_every_item(dataset: SplitLike, num_workers: int, batch: int = 512) -> Split:
    """Every item of ``dataset`` read once, ``batch`` at a time by ``num_workers`` processes
    (none for a dataset of one batch), stacked into one ``Split`` in item order."""
    loader = torch.utils.data.DataLoader(
        BatchReader(dataset), collate_fn=keep_batch, **worker_options(num_workers if len(dataset) > batch else 0, dataset),
        generator=torch.Generator(),  # leaves the global RNG (dropout) alone
        batch_sampler=[list(range(i, min(i + batch, len(dataset)))) for i in range(0, len(dataset), batch)])
    iterator = iter(loader)
    try:
        read = list(batches(loader, iterator, what=f"{type(dataset).__name__} ({len(dataset)} items, read once)"))
    finally:
        end_workers(iterator)
    fields = {name: torch.cat([b[name] for b in read]) for name in read[0]}
    return Split(fields.pop("x"), fields.pop("y"), fields)


def read_all(dataset: SplitLike, num_workers: int) -> Split:
    """The whole dataset as one ``Split``: its own ``to_split()``, or every item read once."""
    if isinstance(dataset, Split):
        return dataset
    if hasattr(dataset, "to_split"):
        return dataset.to_split()
    return read_every_item(dataset, num_workers)
