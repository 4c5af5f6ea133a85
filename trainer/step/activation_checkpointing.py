"""Activation checkpointing (``train.activation_checkpointing``): what a recipe calls, what the trainer checks.

With the setting on, a model keeps only the inputs of its checkpointed blocks during the
forward pass and recomputes each block's forward in the backward pass: less memory for
activations (a larger micro-batch fits), about one more forward pass of compute.

A recipe supports it in one of two ways (trainer/recipe.py, the contract):
- it names its model's blocks in ``Recipe.blocks`` (the declaration FSDP2 shards by, too), and the
  trainer recomputes each of them (``checkpoint_blocks``); a library model's own list serves, e.g. a
  Hugging Face model's ``_no_split_modules``;
- or its model runs each block as ``checkpointed(block, x)`` when ``cfg.train.activation_checkpointing``
  is true, and it returns ``Recipe(..., activation_checkpointing=True)``.
A recipe that does neither is refused with the setting on (``apply_or_refuse``): never silently
trained without it.

``checkpointed`` is graph-safe: torch.utils.checkpoint's non-reentrant form stashes the RNG
state in the forward and restores it for the recompute, so dropout draws the same mask
twice; inside a CUDA graph capture that needs torch >= 2.10 (torch.cuda.get_rng_state and
set_rng_state work during capture from there on; see tests/test_activation_checkpointing_gpu.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from trainer.run.errors import ConfigError

SETTING = "train.activation_checkpointing"
_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def checkpointed(block: torch.nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """``block(*inputs)``, its activations recomputed in backward instead of kept.

    Only while training with grad enabled (``block.training`` and ``torch.is_grad_enabled()``):
    evaluation and ``no_grad`` calls run the block plainly, since nothing is kept for a
    backward pass there. BatchNorm layers inside the block update their running statistics
    once per step, in the forward pass, as without checkpointing (the recompute leaves them).
    """
    if not (block.training and torch.is_grad_enabled()):
        return block(*inputs)
    if torch.compiler.is_compiling():  # the compiler plans the recompute itself and replays no buffer update
        return checkpoint(block, *inputs, use_reentrant=False)
    return checkpoint(block, *inputs, use_reentrant=False, context_fn=partial(_forward_then_recompute, block))


def _forward_then_recompute(block: torch.nn.Module):
    """torch.utils.checkpoint's ``context_fn``: (around the forward, around the recompute)."""
    return contextlib.nullcontext(), _running_stats_left_alone(block)


@contextlib.contextmanager
def _running_stats_left_alone(block: torch.nn.Module) -> Iterator[None]:
    # The recompute runs each BatchNorm in training mode again, which would apply the step's
    # running-statistics update a second time: it updates scratch buffers instead, dropped after.
    norms = [m for m in block.modules() if isinstance(m, _BATCH_NORMS) and m.running_mean is not None]
    kept = [(m.running_mean, m.running_var, m.num_batches_tracked) for m in norms]
    for norm in norms:
        norm.running_mean, norm.running_var, norm.num_batches_tracked = _scratch(norm)
    try:
        yield
    finally:
        for norm, (mean, var, count) in zip(norms, kept):
            norm.running_mean, norm.running_var, norm.num_batches_tracked = mean, var, count


def _scratch(norm: torch.nn.Module):
    """Buffers for one recompute of ``norm``. In training mode a BatchNorm normalizes by the
    batch's statistics and reads its running ones only to update them (no copy needed); with
    ``momentum=None`` (a cumulative average) it reads the batch count as well."""
    count = norm.num_batches_tracked
    if count is not None:
        count = count.clone() if norm.momentum is None else torch.empty_like(count)
    return torch.empty_like(norm.running_mean), torch.empty_like(norm.running_var), count


def apply_or_refuse(cfg, recipe):
    """The recipe, with ``train.activation_checkpointing=true`` carried out: by the recipe itself (its Recipe
    says activation_checkpointing=True), or by the trainer on the blocks the Recipe names (``Recipe.blocks``,
    the same list FSDP2 shards), or refused for a recipe that does neither."""
    if not cfg.train.activation_checkpointing or recipe.activation_checkpointing:
        return recipe
    if recipe.blocks:
        checkpoint_blocks(recipe.blocks)
        return dataclasses.replace(recipe, activation_checkpointing=True)
    raise ConfigError(
        f"{SETTING}=true, but recipe {recipe.name!r} (recipe._target_={cfg.recipe._target_}) neither applies "
        "activation checkpointing (its Recipe says activation_checkpointing=False) nor names its blocks "
        f"(Recipe.blocks). Set {SETTING}=false, or choose a recipe that supports it; a recipe of your own "
        "supports it by naming its model's blocks in Recipe.blocks (the trainer then recomputes each), or by "
        "running them through trainer.step.activation_checkpointing.checkpointed itself and returning "
        "Recipe(..., activation_checkpointing=True)")


def checkpoint_blocks(blocks) -> None:
    """Each of ``blocks`` recomputes its forward in backward from now on, as ``checkpointed`` does (its
    ``forward`` replaced on the instance: the module, its parameters and its names stay as they are, so
    FSDP2 can shard it after, and state dicts are unchanged)."""
    for block in blocks:
        forward = block.forward

        def recomputed(*args, _block=block, _forward=forward, **kwargs):
            if not (_block.training and torch.is_grad_enabled()):
                return _forward(*args, **kwargs)
            if torch.compiler.is_compiling():
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False,
                              context_fn=partial(_forward_then_recompute, _block), **kwargs)

        block.forward = recomputed
