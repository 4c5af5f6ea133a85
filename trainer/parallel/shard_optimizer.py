"""Adam and AdamW under ``train.parallel=fsdp2`` step on each rank's local shards, as plain tensors.

FSDP2's parameters, their gradients and the optimizer state are DTensors. Stepping them as DTensors
sends every kernel of the step through DTensor's dispatch; for the fused kernels that dispatch
first propagates shardings through FakeTensor's fallback, which materializes real tensors: at 9.9B
parameters the first step took 89 s (pytorch issues 140874, 123461), and on torch 2.11 the fused
step keeps one more spec per parameter every step (188174). Adam's update is elementwise and FSDP2
shards whole rows, so the update of each local shard from its own gradient and state is exactly
the DTensor path's: the same kernel on the same numbers.

``on_local_shards(cls)`` is ``cls`` with a ``step`` that, for the length of the step, puts each
parameter's local tensor (with its local gradient and local state) where the optimizer looks, and
runs ``cls``'s own step: every option (fused, foreach, capturable, amsgrad, maximize, a tensor lr,
param groups, decoupled weight decay) behaves as ``cls`` has it. Step hooks run once, around this
step, over the DTensors (not again around ``cls``'s step, over the shards). What the optimizer keeps
stays as torch keeps it: parameters and state are DTensors (the state of a first step is wrapped as
DTensors over the very tensors the step wrote), so sharded checkpoints and resuming at another world
size are unchanged. Clipping runs before the step on the DTensor gradients, over the global norm.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Type

import torch

from graphing.sharded import local_tensor

# Elementwise optimizers whose update on a shard is the update of the whole parameter, restricted
# to it. Any other class (one that mixes elements, as a norm-based update does) keeps the DTensor path.
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW)


class LocalShardStep:
    """Mixin for an elementwise optimizer class: its step runs on the local shards of DTensor parameters."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{type(self).__name__} steps on local shards and takes no closure")
        groups = [group["params"] for group in self.param_groups]
        state = self.state
        local_state: Dict[torch.Tensor, dict] = defaultdict(dict)
        owner: Dict[torch.Tensor, torch.Tensor] = {}  # local tensor -> its DTensor parameter
        for group in self.param_groups:
            local_params = []
            for p in group["params"]:
                local = local_tensor(p)
                if local is not p:
                    local.grad = None if p.grad is None else local_tensor(p.grad)
                if state.get(p):
                    local_state[local] = {key: local_tensor(value) for key, value in state[p].items()}
                owner[local] = p
                local_params.append(local)
            group["params"] = local_params
        self.state = local_state
        try:
            return _without_step_hooks(super().step)(self)
        finally:
            self.state = state
            for group, params in zip(self.param_groups, groups):
                group["params"] = params
            for local, p in owner.items():
                if local is not p:
                    local.grad = None  # the gradient stays the DTensor's (p.grad)
                if not state.get(p) and local_state.get(local):  # this step made the state: keep it as torch would
                    state[p] = {key: _as_shard_of(value, p, local) for key, value in local_state[local].items()}


def _without_step_hooks(step):
    """The optimizer class's own ``step`` (unbound), without the wrapper torch puts around a class's ``step`` to run
    the step hooks once an instance exists (``Optimizer._patch_step_function``, which marks it ``hooked``): the
    hooks ran around ``LocalShardStep.step``, over the DTensor parameters, and must not run again over the shards."""
    if getattr(step, "hooked", False):
        return step.__wrapped__
    return step.__func__


def _as_shard_of(value, p, local):
    """``value`` (a state tensor the step made for ``local``) as a DTensor laid out like ``p``, over the same
    memory; a scalar (the step count) as it is."""
    if not torch.is_tensor(value) or value.dim() == 0 or value.shape != local.shape or p is local:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


_CLASSES: Dict[type, type] = {}


def on_local_shards(cls: Type[torch.optim.Optimizer]) -> Type[torch.optim.Optimizer]:
    """``cls`` stepping on local shards (module docstring); ``cls`` itself if it is not elementwise."""
    if cls not in ELEMENTWISE:
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"{cls.__name__}OnLocalShards", (LocalShardStep, cls),
                             {"__module__": __name__, "__doc__": f"{cls.__name__}, stepped on local shards."})
    return _CLASSES[cls]
