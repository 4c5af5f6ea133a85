"""``train.parallel=fsdp2``: the recipe's model sharded with FSDP2 (``fully_shard``) over all ranks.

Each of the recipe's blocks (``Recipe.blocks``: transformer layers, residual stages) is sharded
on its own, then the root holds what is left (embeddings, head, final norm), on a 1-D mesh over
all ranks; ``train.fsdp.root`` says whether the root is resharded after forward like the blocks,
kept gathered to backward, or split as torchtitan does (embeddings apart, resharded; the rest
gathered). A block's parameters are all-gathered just before its forward (and again before its
backward with ``train.fsdp.reshard_after_forward=true``) and its gradients reduce-scattered
after its backward, on FSDP2's own streams, which overlap the neighbouring blocks' compute.
The optimizer then steps on each rank's shards only (DTensors): a rank holds 1/N of the
weights, gradients and optimizer state.

Mixed precision follows ``train.precision`` through ``MixedPrecisionPolicy``: bf16 all-gathers
and computes with bf16 copies of the fp32 shards and reduces gradients in
``train.fsdp.reduce_dtype``; the step's autocast stays on, so the ops autocast keeps in fp32 (norms,
softmax, the loss) stay there, as under DDP. fp32 shards, gathers and reduces in fp32.

``train.fsdp.init``: ``host`` shards the model the recipe built on the host, so a run starts
from the same weights as under DDP with the same seed; ``meta`` lets the recipe build it on the
meta device (``Runtime.init_device``), shards it, then each rank allocates and draws only its own
shards on its device (``Recipe.init_weights``), so no rank ever holds the whole model.

The whole step (forward, backward with FSDP2's collectives, clipping, optimizer) is captured
by graph.mode=full like a DDP step: FSDP2's streams fork from the capture stream and join it
within each step, and nothing outside a step leaves an event that the captured step waits on
(checked on one GPU, tests/test_fsdp_gpu.py). What FSDP2 cannot carry is refused by the plan
(``fsdp_spec``, called through trainer/parallel/parallelism.py, whose ``Parallelism`` the rest of the trainer
asks: its ``place_model`` calls ``sharded_model`` here); its checkpoints, and its whole tensors for
best.pt, are trainer/checkpoint/dcp_shards.py's.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from graphing import GraphMode, GraphOptions
from graphing.sharded import is_dtensor
from trainer.run.errors import ConfigError


@dataclass(frozen=True)
class FSDPSpec:
    """``train.fsdp`` of ``train.parallel=fsdp2`` (trainer/parallel/sharding.py)."""
    reshard_after_forward: bool
    reduce_dtype: str  # fp32 | bf16
    init: str  # host | meta
    root: str = "resharded"  # resharded | gathered | split (conf/schema.py FSDPRoot)


def fsdp_spec(cfg, precision: str, graph: GraphOptions, optimizer_target: str, optimizer_cls: type) -> FSDPSpec:
    """``train.fsdp`` of a run under ``train.parallel=fsdp2``, checked (trainer/parallel/parallelism.py ``plan_parallelism``
    calls it): what FSDP2 cannot carry (fp16's loss scale, partial and compile graphs, fused SGD) is refused by name."""
    t = cfg.train
    if precision == "fp16":
        raise ConfigError("train.precision=fp16 with train.parallel=fsdp2: the loss scale's inf/NaN check would have "
                          "to agree across ranks on the device, inside the graph, which torch's sharded scaler does "
                          "only in unscale_: set train.precision=bf16 (no loss scale needed), or train.parallel=ddp")
    if graph.mode in (GraphMode.partial, GraphMode.compile):
        raise ConfigError(f"graph={graph.mode.value} with train.parallel=fsdp2: "
                          + ("torch.cuda.make_graphed_callables replays the model without FSDP2's all-gather and "
                             "reduce-scatter hooks" if graph.mode is GraphMode.partial else
                             "torch.compile's reduce-overhead graphs would capture FSDP2's collectives without "
                             "their streams") + ": set graph=full (the whole step, FSDP2's collectives included) "
                          "or graph=eager")
    if t.fsdp.reduce_dtype.value == "bf16" and precision != "bf16":
        raise ConfigError(f"train.fsdp.reduce_dtype=bf16 reduces bf16 gradients, but train.precision resolves to "
                          f"{precision}: set train.precision=bf16, or train.fsdp.reduce_dtype=fp32")
    check_optimizer(optimizer_target, optimizer_cls, captured=graph.mode is GraphMode.full,
                    optim_keys=list(cfg.recipe.optim.keys()))
    return FSDPSpec(reshard_after_forward=t.fsdp.reshard_after_forward, reduce_dtype=t.fsdp.reduce_dtype.value,
                    init=t.fsdp.init.value, root=t.fsdp.root.value)


def mixed_precision_policy(precision: str, reduce_dtype: str):
    """FSDP2's ``MixedPrecisionPolicy`` for ``train.precision`` and ``train.fsdp.reduce_dtype`` (the plan has
    refused a bf16 reduction of fp32 gradients)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=torch.bfloat16 if reduce_dtype == "bf16" else torch.float32)


def shard_model(model: torch.nn.Module, blocks: Iterable[torch.nn.Module], device: torch.device, *,
                precision: str, reshard_after_forward: bool, reduce_dtype: str, root: str = "resharded",
                recipe: str = "") -> torch.nn.Module:
    """``model`` sharded in place: each of ``blocks`` on its own, then what they leave as ``root`` says
    (``train.fsdp.root``), on a 1-D mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision_policy(precision, reduce_dtype)
    blocks = list(blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    if root == "split":
        for embedding in embeddings_outside(model, blocks, recipe):
            fully_shard(embedding, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # The root's weights are the last gathered in forward and the first needed in backward: kept gathered, its
    # all-gather runs once a step (FSDP2's default for a root; the capture guard reshards it before a capture:
    # graphing/full.py reshard_units).
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward and root == "resharded",
                mp_policy=policy)
    return model


def embeddings_outside(model: torch.nn.Module, blocks: List[torch.nn.Module], recipe: str) -> List[torch.nn.Module]:
    """The ``nn.Embedding`` modules of ``model`` outside ``blocks`` (``train.fsdp.root=split`` shards each on its
    own); one whose weight another module also holds (a head tied to the embedding, as GPT-2's) is refused: FSDP2
    cannot shard one parameter in two units."""
    inside = {id(m) for block in blocks for m in block.modules()}
    found = [m for m in model.modules() if isinstance(m, torch.nn.Embedding) and id(m) not in inside]
    if not found:
        raise ConfigError(f"train.fsdp.root=split: recipe {recipe!r} has no nn.Embedding outside its blocks to shard "
                          "on its own: set train.fsdp.root=gathered (the root kept gathered) or resharded")
    for embedding in found:
        own = {id(m) for m in embedding.modules()}
        for name, module in model.named_modules():
            if id(module) in own:
                continue
            if any(p is embedding.weight for p in module.parameters(recurse=False)):
                raise ConfigError(f"train.fsdp.root=split: recipe {recipe!r} ties its embedding's weight to {name} "
                                  "(one parameter in two FSDP2 units): set train.fsdp.root=gathered, or untie them")
    return found


def materialize(model: torch.nn.Module, device: torch.device, init_weights, recipe: str) -> None:
    """A model built on the meta device and sharded: each rank allocates its own shards on ``device`` and
    draws them (``Recipe.init_weights``), under the run's seed."""
    if init_weights is None:
        raise ConfigError(f"train.fsdp.init=meta: recipe {recipe!r} built its model on the meta device but gives no "
                          "Recipe.init_weights to draw its weights after sharding: give one, or set "
                          "train.fsdp.init=host")
    model.to_empty(device=device)
    if device.type == "cpu":
        # DTensor draws a CPU shard from the local generator (its offset-based RNG is for accelerators), so
        # ranks with one seed would draw equal shards: each rank offsets it. seed_rank_streams reseeds next.
        torch.manual_seed(torch.initial_seed() + dist.get_rank())
    with torch.no_grad():
        init_weights(model)


def check_blocks(model: torch.nn.Module, blocks: List[torch.nn.Module], recipe: str) -> Optional[str]:
    """Why ``Recipe.blocks`` cannot be sharded one by one, or None; a warning's text when it names none."""
    inside = {id(m) for m in model.modules()}
    for block in blocks:
        if id(block) not in inside or block is model:
            raise ConfigError(f"recipe {recipe!r}: Recipe.blocks holds a {type(block).__name__} that is not a "
                              "submodule of its model (or is the model itself): list the model's own blocks")
    ids = {id(b) for b in blocks}
    for block in blocks:
        nested = [m for m in block.modules() if m is not block and id(m) in ids]
        if nested:
            raise ConfigError(f"recipe {recipe!r}: Recipe.blocks holds a {type(nested[0]).__name__} inside another "
                              f"of its blocks ({type(block).__name__}): list blocks that do not nest")
    if not blocks:
        return (f"recipe {recipe!r} names no blocks (Recipe.blocks), so train.parallel=fsdp2 shards its model as one "
                "unit: every rank all-gathers all of it for each forward and backward, which saves memory between "
                "steps only. List the model's repeated blocks in Recipe.blocks to shard them one by one")
    return None


def check_optimizer(optimizer_target: str, cls: type, captured: bool, optim_keys: Iterable[str] = ()) -> None:
    """Refuses an optimizer whose step cannot run on DTensor shards as this run needs it, by name; the change to
    AdamW it proposes drops the keys of ``recipe.optim`` (``optim_keys``) that AdamW does not take."""
    if captured and issubclass(cls, torch.optim.SGD):
        takes = inspect.signature(torch.optim.AdamW).parameters
        drop = "".join(f" ~recipe.optim.{key}" for key in optim_keys if not key.startswith("_") and key not in takes)
        raise ConfigError(
            f"recipe.optim._target_={optimizer_target} under train.parallel=fsdp2 with a whole-step graph: SGD steps "
            "inside a CUDA graph only with fused=True (its other kernels read a tensor lr on the host), and torch's "
            "DTensor has no fused SGD for sharded parameters. Use AdamW (fused and foreach both run on shards): "
            f"recipe.optim._target_=torch.optim.AdamW{drop} recipe.optim.lr=0.001 (SGD's learning rate is rarely "
            "AdamW's); or graph=eager, or train.parallel=ddp")


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s result as a plain tensor: over DTensor gradients it is a replicated DTensor,
    whose local value is the global norm."""
    return norm.to_local() if is_dtensor(norm) else norm


def sharded_model(recipe, device: torch.device, spec, precision: str) -> torch.nn.Module:
    """The recipe's model, sharded over every rank as ``spec`` (the plan's ``train.fsdp``) says, on ``device``."""
    from trainer.run.runtime import print_once

    model = recipe.model
    blocks = list(recipe.blocks)
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if spec.init == "meta" and not on_meta:
        raise ConfigError(f"train.fsdp.init=meta: recipe {recipe.name!r} built its model on the host, not on the "
                          "meta device: set train.fsdp.init=host, or build the model `with torch.device("
                          "rt.init_device)` in the recipe and give Recipe.init_weights (trainer/recipe.py)")
    if on_meta and spec.init != "meta":
        raise ConfigError(f"recipe {recipe.name!r} built its model on the meta device, which only "
                          "train.fsdp.init=meta materializes: build it on the host (rt.init_device), or set "
                          "train.fsdp.init=meta")
    warning = check_blocks(model, blocks, recipe.name)
    if warning:
        print_once(f"WARNING: {warning}")
    if not on_meta:
        model = model.to(device)
    shard_model(model, blocks, device, precision=precision, reshard_after_forward=spec.reshard_after_forward,
                reduce_dtype=spec.reduce_dtype, root=spec.root, recipe=recipe.name)
    if on_meta:
        materialize(model, device, recipe.init_weights, recipe.name)
    return model
