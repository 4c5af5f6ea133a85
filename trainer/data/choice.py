"""Which loader a split gets (``recipe.data.loader``), and building it: the device loader
when the data fits in a share of free memory (the host then pays nothing per step), the host
loader otherwise, and always for a training set whose items change with the epoch.
"""
from __future__ import annotations

import os

import torch

from trainer.data.device_loader import DeviceLoader
from trainer.data.host_loader import HostLoader
from trainer.data.items import draws_per_epoch, read_all, sample_item
from trainer.run.errors import ConfigError
from trainer.recipe import SplitLike
from trainer.run.runtime import Runtime

DEVICE_MEMORY_SHARE = 0.3  # loader=auto keeps a split on the device when it takes at most this share of free memory


def split_bytes(dataset: SplitLike) -> int:
    return len(dataset) * sum(v.numel() * v.element_size() for v in sample_item(dataset).values())


def fits_on_device(nbytes: int, device: torch.device) -> bool:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 2**33
    return nbytes <= DEVICE_MEMORY_SHARE * free


def choose_loader(kind: str, train: SplitLike, test: SplitLike, device: torch.device) -> str:
    """``device`` or ``host`` for ``recipe.data.loader`` (auto: device when both splits fit, and
    the training set's items do not change with the epoch)."""
    if kind == "host":
        return kind
    if draws_per_epoch(train):
        if kind == "auto":
            return "host"
        raise ConfigError(f"recipe.data.loader=device holds the training set as read once, but it draws new items "
                          f"each epoch ({train!r}): set recipe.data.loader=host (or auto) to read it through "
                          "DataLoader workers (recipe.data.num_workers of them)")
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
