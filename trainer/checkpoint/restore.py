"""A checkpoint's model and optimizer state put back into the live ones, in place.

In place, because DDP and any captured CUDA graph keep reading the tensors they were given: a
restore before warm-up and capture must not swap them. The caller names two formats: the one the
checkpoint was read in (``choice.format_of`` of its path), which puts its entries in
(``CheckpointFormat.load_model``, ``load_optimizer``), and the one its run writes (``live``), which
says how whole tensors go into the live model: into a sharded model's shards too. What is added
here is the policy around that: a checkpoint of another model refused by its settings, and the
optimizer's tensor hyper-parameters kept.

``Optimizer.load_state_dict`` replaces each param group's ``lr`` with the saved object. Our lr is a
device tensor that a captured CUDA graph reads by address, so ``load_optimizer_state`` copies the
saved values into the live tensors instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch

from trainer.checkpoint.format import CheckpointFormat
from trainer.run.errors import ConfigError


def load_model_state(model: torch.nn.Module, state: Dict[str, Any], config: Dict[str, Any], *,
                     read_in: CheckpointFormat, live: CheckpointFormat, resume: str = "auto",
                     path: Optional[Path] = None) -> None:
    """``state["model"]`` (read in ``read_in``) into ``model`` (whose run writes ``live``); a checkpoint of another
    model is refused with the ``recipe.model`` settings that differ between its config and this run's named."""
    try:
        read_in.load_model(model, state["model"], live)
    except RuntimeError as e:
        saved = (state.get("config") or {}).get("recipe", {}).get("model") or {}
        now = (config.get("recipe") or {}).get("model") or {}
        differ = [f"recipe.model.{k}={_shown(saved, k)} there, {_shown(now, k)} here"
                  for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        where = f" ({path})" if path is not None else ""
        cause = "; ".join(differ) if differ else str(e).strip().splitlines()[0][:300]
        raise ConfigError(f"checkpoint.resume={resume} found a checkpoint{where} of another model ({cause}): set the "
                          "same recipe.model settings to resume it, or checkpoint.resume=never to start over") from None


def _shown(settings: Dict[str, Any], key: str) -> str:
    return "unset (the default)" if key not in settings else str(settings[key]).lower() if isinstance(
        settings[key], bool) else str(settings[key])


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any, *, model: torch.nn.Module,
                         read_in: CheckpointFormat, live: CheckpointFormat) -> None:
    """``saved`` (the ``optimizer`` entry read in ``read_in``) into ``optimizer``, keeping its live tensor
    hyper-parameters.

    Loading swaps each param group's entries for the saved objects, so a tensor ``lr`` would become a
    new CPU tensor: the schedule and any captured graph would then hold a stale address. Here the saved
    values are copied into the tensors the optimizer already had (on their device). Load before
    capturing. ``model``: the optimizer's model (a sharded one's shards take their part of each state).
    """
    tensors_of = [{k: v for k, v in g.items() if k != "params" and isinstance(v, torch.Tensor)}
                  for g in optimizer.param_groups]
    read_in.load_optimizer(model, optimizer, saved, live)
    for group, tensors in zip(optimizer.param_groups, tensors_of):
        for key, tensor in tensors.items():
            with torch.no_grad():
                tensor.copy_(torch.as_tensor(group[key]))
            group[key] = tensor
