"""A checkpoint's model and optimizer state put back into the live ones, in place.

In place, because DDP and any captured CUDA graph keep reading the tensors they were given: a
restore before warm-up and capture must not swap them. What is read decides how (a sharded
checkpoint's ``ShardedState`` loads its shards into any model, any world size); whole tensors go in
as the live model's format puts them (``CheckpointFormat.load_whole_model``), the run's format when
it passes one, else the format ``model`` would be written in.

``Optimizer.load_state_dict`` replaces each param group's ``lr`` with the saved object. Our lr is a
device tensor that a captured CUDA graph reads by address, so ``load_optimizer_state`` copies the
saved values into the live tensors instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch

from trainer.checkpoint.choice import format_for
from trainer.checkpoint.dcp_shards import ShardedState
from trainer.checkpoint.format import CheckpointFormat
from trainer.errors import ConfigError


def load_model_state(model: torch.nn.Module, state: Dict[str, Any], config: Dict[str, Any], *,
                     resume: str = "auto", path: Optional[Path] = None,
                     fmt: Optional[CheckpointFormat] = None) -> None:
    """``model.load_state_dict(state["model"])`` (into a sharded model's shards too); a checkpoint of another
    model is refused with the ``recipe.model`` settings that differ between its config and this run's named."""
    try:
        put_model_state(model, state["model"], fmt)
    except RuntimeError as e:
        saved = (state.get("config") or {}).get("recipe", {}).get("model") or {}
        now = (config.get("recipe") or {}).get("model") or {}
        differ = [f"recipe.model.{k}={_shown(saved, k)} there, {_shown(now, k)} here"
                  for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        where = f" ({path})" if path is not None else ""
        cause = "; ".join(differ) if differ else str(e).strip().splitlines()[0][:300]
        raise ConfigError(f"checkpoint.resume={resume} found a checkpoint{where} of another model ({cause}): set the "
                          "same recipe.model settings to resume it, or checkpoint.resume=never to start over") from None


def put_model_state(model: torch.nn.Module, saved: Any, fmt: Optional[CheckpointFormat] = None) -> None:
    """A checkpoint's model into ``model``, in place: from a sharded checkpoint's shards (any world size, a
    plain model too), or whole tensors (into a sharded model's shards too)."""
    if isinstance(saved, ShardedState):
        saved.load_model(model)
    else:
        (fmt or format_for(model)).load_whole_model(model, saved)


def _shown(settings: Dict[str, Any], key: str) -> str:
    return "unset (the default)" if key not in settings else str(settings[key]).lower() if isinstance(
        settings[key], bool) else str(settings[key])


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                         model: Optional[torch.nn.Module] = None, fmt: Optional[CheckpointFormat] = None) -> None:
    """``optimizer.load_state_dict(saved)`` that keeps the live tensor hyper-parameters.

    ``load_state_dict`` swaps each param group's entries for the saved objects, so a
    tensor ``lr`` would become a new CPU tensor: the schedule and any captured graph
    would then hold a stale address. Here the saved values are copied into the
    tensors the optimizer already had (on their device). Load before capturing. ``model``: the
    optimizer's model, needed when it is sharded (its shards take their part of each state).
    """
    live = [{k: v for k, v in g.items() if k != "params" and isinstance(v, torch.Tensor)}
            for g in optimizer.param_groups]
    if isinstance(saved, ShardedState):
        saved.load_optimizer(model, optimizer)
    elif model is None:
        optimizer.load_state_dict(saved)
    else:
        (fmt or format_for(model)).load_whole_optimizer(model, optimizer, saved)
    for group, tensors in zip(optimizer.param_groups, live):
        for key, tensor in tensors.items():
            with torch.no_grad():
                tensor.copy_(torch.as_tensor(group[key]))
            group[key] = tensor
