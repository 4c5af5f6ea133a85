"""A process group of one rank in the test's own process, and the small block model that tests of a user's own
FSDP2 loop shard in it (tests/test_fsdp_graphed_step_gpu.py, tests/test_float8_gpu.py)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F


@contextlib.contextmanager
def group_of_one(backend: str) -> Iterator[None]:
    """A group of one rank (``gloo`` or ``nccl`` on the current GPU) for the block's length; one that is already up
    (another module's) is used as it is and left up."""
    if dist.is_initialized():
        yield
        return
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), \
            torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """``depth`` Blocks of ``width``, then a head to one output."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
