"""FSDP2's float8 all-gather with each weight cast to float8 once a step, not once a gather.

torchao casts a weight shard to float8 inside FSDP2's pre-all-gather hook, each time the weight is
gathered: for the forward and again for the backward's re-gather (``reshard_after_forward``), three
eager kernels each time (scale, clamp, cast: 21 bytes moved per element), beside compute on the
all-gather's stream (224 casts a step at Llama 1b; RESULTS.md, "Where the time goes"). Here the
step's first work, right after the scales' one all-reduce, casts every weight shard (one compiled
function under ``graph.compile_model``, 5 bytes per element) into a tensor each of the step's gathers
then sends; the bytes are the ones torchao's cast makes (tests/test_float8_gpu.py).

A cast lives for one step: set at its start (``WeightCasts.__call__``), dropped at its end
(``WeightCasts.drop``, after the optimizer moved the weights; a version counter cannot tell, fused
AdamW bumps none), and sent only with the scale it was made with. A gather outside a step (a user's
forward between steps) finds none and casts as torchao does. In a CUDA graph this bookkeeping runs
once, at capture; every replay casts again before its gathers read the casts.

The price: one float8 byte per element of each rank's converted weights, held through the step,
where torchao's casts lived one gather long (0.8 GiB more reserved at gpt_1b and at Llama 1b on 2
GPUs; still below bf16's).

What it reads of torchao is private (the weight wrapper's ``_tensor``, ``_dtype``, ``_precomputed_scale``
and its one-argument ``fsdp_pre_all_gather``): requirements-float8.txt bounds torchao to the releases it
was tested with, and ``WeightCasts.surface_differs`` checks a run's torchao at the start; where it
differs, the run gathers through torchao's own cast, saying so once.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from graphing.float8_scales import SCALE
from graphing.sharded import is_dtensor

CAST = "_graphed_float8_cast"  # the attribute on a weight's local tensor that holds this step's cast
# The torchao releases whose weight wrapper (WeightWithDynamicFloat8CastTensor) this module was tested against:
# 0.17 on the GPUs (torch 2.11), 0.18 on the CPU (torch 2.14; its wrapper differs from 0.17's in no name read here)
TESTED_TORCHAO = ">=0.17,<0.19"
WRAPPER_READS = ("_tensor", "_dtype", SCALE)  # the shard in high precision, its float8 dtype, the precomputed scale
PRE_ALL_GATHER_ARGUMENTS = ("self", "mesh")  # the form of torchao's hook that _pre_all_gather stands in for


@dataclass
class _Cast:
    data: torch.Tensor  # the shard in float8, as torchao's pre-all-gather would make it
    scale: torch.Tensor  # the scale it was cast with (torchao's precomputed one, by identity)


def cast_shards(shards: List[torch.Tensor], scales: List[torch.Tensor], dtype: torch.dtype) -> List[torch.Tensor]:
    """torchao's weight cast (``hp_tensor_and_scale_to_float8``: to fp32, times the scale, clamped to the float8
    range, to float8), for every shard."""
    top = torch.finfo(dtype).max
    return [(shard.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype)
            for shard, scale in zip(shards, scales)]


def wrapper_lacks(local: torch.Tensor) -> List[str]:
    """What ``local`` (a weight's local tensor) lacks of torchao's weight wrapper as this module reads it; nothing
    for a tensor FSDP2 gathers as it is (no ``fsdp_pre_all_gather``)."""
    hook = getattr(type(local), "fsdp_pre_all_gather", None)
    if hook is None:
        return []
    lacks = [f"attribute {name}" for name in WRAPPER_READS if not hasattr(local, name)]
    if tuple(inspect.signature(hook).parameters) != PRE_ALL_GATHER_ARGUMENTS:
        lacks.append(f"fsdp_pre_all_gather({', '.join(PRE_ALL_GATHER_ARGUMENTS)})")
    return lacks


def _pre_all_gather(local: torch.Tensor, mesh) -> Tuple[tuple, tuple]:
    """The weight's FSDP2 pre-all-gather (torchao's, one-argument form): this step's cast, else torchao's own."""
    cast: Optional[_Cast] = getattr(local, CAST, None)
    if cast is not None and cast.scale is getattr(local, SCALE, None):
        return (cast.data,), (cast.scale,)
    return type(local).fsdp_pre_all_gather(local, mesh)


class WeightCasts:
    """Casts every converted weight of ``model`` that FSDP2 gathers in float8, once, with the scales torchao's
    precompute just set: call it right after ``precompute_float8_dynamic_scale_for_fsdp`` at each step's start,
    and ``drop`` at its end."""

    def __init__(self, model: torch.nn.Module, compiled: bool):
        self.model = model
        self.cast_on: List[torch.Tensor] = []  # the local tensors this step's casts were set on
        # One function over every shard: 0.79 ms a step graphed at Llama 1b on an H200, 5.0 s to compile (a kernel
        # per shape); RESULTS.md has the alternatives measured
        self._cast: Callable = torch.compile(cast_shards, dynamic=False) if compiled else cast_shards

    def surface_differs(self) -> Optional[str]:
        """What the model's torchao weight wrappers lack of what the cast reads (one line, naming the torchao
        version and the tested range), or None where they have it all."""
        for param in self.model.parameters():
            local = param._local_tensor if is_dtensor(param) else None
            lacks = wrapper_lacks(local) if local is not None else []
            if lacks:
                return (f"torchao {_torchao_version()}'s {type(local).__name__} lacks {', '.join(lacks)} (tested: "
                        f"torchao{TESTED_TORCHAO})")
        return None

    def weights(self) -> List[torch.Tensor]:
        """The local tensor of each weight FSDP2 gathers in float8, asked each step: FSDP2 gives a parameter a new
        local tensor where it must (its first forward pads one, ``load_state_dict(assign=True)`` swaps the
        parameter), and the hook belongs to the local tensor."""
        found = []
        for param in self.model.parameters():
            local = param._local_tensor if is_dtensor(param) else None
            if local is not None and hasattr(local, SCALE):
                if CAST not in local.__dict__:
                    local.fsdp_pre_all_gather = types.MethodType(_pre_all_gather, local)  # this tensor's hook only
                    setattr(local, CAST, None)
                found.append(local)
        return found

    @torch.no_grad()
    def __call__(self) -> None:
        weights = self.weights()
        scales = [getattr(local, SCALE) for local in weights]
        if any(scale is None for scale in scales):
            return  # no precompute ran: each gather finds its weight's scale itself (torchao's path)
        if not weights:
            return
        for local, data, scale in zip(weights, self._cast([local._tensor for local in weights], scales,
                                                          weights[0]._dtype), scales):
            setattr(local, CAST, _Cast(data=data, scale=scale))
        self.cast_on = weights

    def drop(self) -> None:
        """The step's casts let go: its optimizer moved the weights they were made from."""
        for local in self.cast_on:
            setattr(local, CAST, None)
        self.cast_on = []


def _torchao_version() -> str:
    import torchao  # imported already: the weights it is asked about are torchao's

    return torchao.__version__
