"""``RunningMeans``: the means of per-step values, kept on the device and read once per log interval.

    metrics = graphing.RunningMeans(["loss", "grad_norm"], device)

    def train_step(model, x, y):
        ...
        metrics.add(loss=loss.detach(), grad_norm=grad_norm)   # in place into fixed buffers: capture-safe

    for it in range(steps):
        step(x, y)
        if (it + 1) % log_every == 0:
            means = metrics.read_and_reset()                   # one host sync: {"loss": 2.31, "grad_norm": 0.84}

Inside the step ``add`` only adds in place into two tensors made here, so a captured graph
adds to the same buffers on every replay. Outside the step, ``read_and_reset`` reads sums and
counts with one host sync (``.tolist()`` of one small tensor) and zeroes them in place, on the
current stream, after the steps before it and before the next.
"""
from __future__ import annotations

import math
from typing import Dict, Sequence, Union

import torch
import torch.distributed as dist

from graphing.sharded import whole_value

Number = Union[int, float, torch.Tensor]


class RunningMeans:
    """Sums and counts of named scalar values, on the device; each ``add`` counts once per name.

    ``add(name=value, ...)`` inside the step: ``value`` is a one-element tensor on ``device`` (a
    Python number is baked into a captured graph as a constant). ``read_and_reset()`` outside it:
    ``{name: sum / count}`` since the last reset, NaN for a name added nothing. Sums are float64,
    so a long interval of float32 losses loses no precision.
    """

    def __init__(self, names: Sequence[str], device: Union[str, torch.device], dtype: torch.dtype = torch.float64):
        self.names = tuple(names)
        if len(set(self.names)) != len(self.names) or not self.names:
            raise ValueError(f"RunningMeans needs distinct names, got {list(self.names)}")
        self._index = {name: i for i, name in enumerate(self.names)}
        # One tensor for sums and counts: one read, one all-reduce. Made once; only written in place.
        self.totals = torch.zeros(2, len(self.names), dtype=dtype, device=device)

    def add(self, **values: Number) -> None:
        """Adds each value to its name's sum and 1 to its count, in place (no host sync). A DTensor (a norm
        over FSDP2's sharded gradients) is taken whole: a collective, so every rank adds it."""
        for name, value in values.items():
            i = self._index.get(name)
            if i is None:
                raise KeyError(f"RunningMeans has no {name!r}: it was made with {list(self.names)}")
            if isinstance(value, torch.Tensor):
                value = whole_value(value)  # a DTensor (FSDP2's clip_grad_norm_ returns one): its whole value
                if value.numel() != 1:
                    raise ValueError(f"RunningMeans.add({name}=...) takes one value, got shape {tuple(value.shape)}: "
                                     "reduce it first (.mean() or .sum())")
                value = value.detach().reshape(())
            elif self.totals.is_cuda and torch.cuda.is_current_stream_capturing():
                raise ValueError(f"RunningMeans.add({name}={value!r}) while a graph is captured: a Python number "
                                 "would be replayed as this constant forever; pass a device tensor")
            self.totals[0, i].add_(value)  # add_ on the view: `totals[0, i] += v` would also copy it back
            self.totals[1, i].add_(1)

    def read_and_reset(self, all_ranks: bool = False) -> Dict[str, float]:
        """``{name: mean}`` since the last reset (NaN where nothing was added), then zeroes the sums.

        One host sync. ``all_ranks=True``: sums and counts are first all-reduced over the default
        process group, so every rank gets the job's means; a collective, so every rank must call it.
        Call it outside the step (it is not capture-safe, by design: it reads on the host).
        """
        totals = self.totals
        if all_ranks and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            totals = totals.clone()
            dist.all_reduce(totals)
        sums, counts = totals.tolist()
        self.totals.zero_()
        return {name: s / c if c else math.nan for name, s, c in zip(self.names, sums, counts)}
