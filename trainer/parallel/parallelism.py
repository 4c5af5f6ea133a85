"""How the recipe's model is parallel over the ranks (``train.parallel``): decided once, by the plan.

``Parallelism`` is the one answer: the model replicated on every rank, its gradients all-reduced
by DDP (``train.ddp``, ``DDPSpec``), or sharded over the ranks by FSDP2 (``train.fsdp``, ``FSDPSpec``:
trainer/parallel/sharding.py). Every part of the trainer that differs between the two asks it, never the
model: the session (a process group even on one rank, a meta-device init), the Trainer (the model
put on the device, what graphing's executor wraps it with, whether the compiled model takes its
loss, whether the optimizer steps on shards), the checkpoint format (trainer/checkpoint/choice.py),
the config a run records. ``float8`` (``train.float8``, trainer/parallel/float8.py) is a field here
too: the layers it converts are converted where the model is placed, and what the step runs first
and last (the float8 scales and casts of FSDP2's float8 all-gather) is asked here. What comes next
(a tensor-parallel mesh dimension) is a field here, read by the same parts.

graphing, a library for any loop, asks the model itself (graphing/sharded.py); the answers agree,
since the model is sharded here (``place_model``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from omegaconf import OmegaConf

from conf.schema import DDPConfig, FSDPConfig, as_typed, settings_the_user_changed
from graphing import GraphOptions
from graphing.compat import ddp_buffer_sync_argument
from trainer.run.errors import ConfigError
from trainer.parallel.float8 import Float8Spec, StepHook, float8_spec
from trainer.parallel.sharding import FSDPSpec, fsdp_spec, sharded_model


@dataclass(frozen=True)
class DDPSpec:
    """``train.ddp``: DDP's keyword arguments, and the communication hook its all-reduce goes
    through (None: DDP's own, in the gradients' dtype)."""
    kwargs: Dict[str, Any]
    comm_hook: Optional[Callable]


@dataclass(frozen=True)
class Parallelism:
    """``train.parallel``, resolved: ``data_parallel`` holds DDP's settings (the model replicated, wrapped in DDP
    when a process group is up) or FSDP2's (the model sharded over every rank)."""
    data_parallel: Union[DDPSpec, FSDPSpec]
    float8: Optional[Float8Spec] = None  # train.float8: the Linear layers of the recipe's blocks in float8

    @property
    def sharded(self) -> bool:
        """Whether each rank holds only shards of the model (DTensors): the optimizer steps on shards, every rank
        writes its own part of a checkpoint, and FSDP2's device mesh needs a process group even on one rank."""
        return isinstance(self.data_parallel, FSDPSpec)

    @property
    def init_on_meta(self) -> bool:
        """Whether the recipe builds its model on the meta device (``train.fsdp.init=meta``)."""
        return self.sharded and self.data_parallel.init == "meta"

    def place_model(self, recipe, device: torch.device, precision: str,
                    memory_format: torch.memory_format) -> torch.nn.Module:
        """The recipe's model on ``device``: moved there whole, or each block and the root sharded over all ranks;
        with float8, its layers converted first (before sharding, and before the optimizer is built)."""
        if self.float8 is not None:
            from trainer.run.runtime import print_once

            converted = self.float8.convert(recipe.model, recipe.blocks, recipe.name)
            print_once(self.float8.describe(len(converted), precision))
        if self.sharded:
            return sharded_model(recipe, device, self.data_parallel, precision)
        return recipe.model.to(device, memory_format=memory_format)

    @property
    def executor_arguments(self) -> Dict[str, Any]:
        """What graphing's executor wraps the model with: DDP's settings; none for FSDP2, which communicates itself."""
        if self.sharded:
            return {}
        return {"ddp_kwargs": self.data_parallel.kwargs, "comm_hook": self.data_parallel.comm_hook}

    def step_hooks(self, model: torch.nn.Module) -> Tuple[StepHook, StepHook]:
        """What every training and evaluation step runs first and last, inside its graph (None: nothing):
        float8's weight scales and casts for FSDP2's float8 all-gather (trainer/parallel/float8.py)."""
        return (None, None) if self.float8 is None else self.float8.step_hooks(model)

    def compile_with_loss(self, graph: GraphOptions) -> bool:
        """Whether ``graph.compile_model`` compiles the model and its loss as one function. Not when sharded:
        graphing then compiles block by block (graphing/full.py ``compile_sharded_units``), the loss apart."""
        return graph.compile_model and not self.sharded


def plan_parallelism(cfg, device: torch.device, world_size: int, precision: str, graph: GraphOptions,
                     optimizer_target: str, optimizer_cls: type) -> Parallelism:
    """``train.parallel`` and its settings, checked (called by trainer/plan.py): each parallel's settings are
    refused under the other, then DDP's own checks (``ddp_spec``) or FSDP2's (trainer/parallel/sharding.py ``fsdp_spec``)."""
    t = cfg.train
    parallel = t.parallel.value
    float8 = float8_spec(cfg, device, precision, compiled=graph.compile_model)  # torchao's absence said first
    # The other parallel's settings group: (its key, the train.parallel it belongs to, its schema). Only what the user
    # set there is refused: a recipe's own presets for the other mode (gpt_1b's fsdp2 init=meta) let a user switch
    group, owner, schema = ("fsdp", "fsdp2", FSDPConfig) if parallel == "ddp" else ("ddp", "ddp", DDPConfig)
    changed = settings_the_user_changed(cfg, f"train.{group}", schema)
    # FSDP2 never broadcasts buffers while training, as broadcast_buffers=false (a recipe's own choice, e.g.
    # cifar10_resnet18's) asks; evaluation takes rank 0's under both (trainer/trainer.py take_rank0_buffers)
    changed.pop("broadcast_buffers", None)
    defaults = OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True)
    for key, value in changed.items():
        shown, default = (as_typed(v) for v in (value, defaults[key]))
        raise ConfigError(f"train.{group}.{key}={shown} is a setting of train.parallel={owner}, but this run uses "
                          f"train.parallel={parallel}: drop train.{group}.{key}={shown} from the overrides (or set "
                          f"train.{group}.{key}={default}, its default), or set train.parallel={owner}")
    if parallel == "ddp":
        return Parallelism(ddp_spec(cfg, world_size), float8)
    return Parallelism(fsdp_spec(cfg, precision, graph, optimizer_target, optimizer_cls), float8)


def ddp_spec(cfg, world_size: int) -> DDPSpec:
    """``train.ddp`` as DDP's keyword arguments and communication hook (checked where DDP is used)."""
    cfg_ddp = cfg.train.ddp
    if cfg_ddp.static_graph and cfg.train.grad_accum > 1 and world_size > 1:
        # Measured on torch 2.14: DDP's reducer fails an internal assert (expect_autograd_hooks_)
        # when a static graph's first backward runs under no_sync, as every step's first micro-batch does.
        raise ConfigError(f"train.ddp.static_graph=true with train.grad_accum={cfg.train.grad_accum}: DDP built with "
                          "static_graph fails when its first backward runs under no_sync, as the first micro-batch "
                          "of a step does. Set train.ddp.static_graph=false, or train.grad_accum=1")
    # Gradients as views into DDP's all-reduce buckets: after the all-reduce nothing is
    # copied back into them (one copy kernel per parameter less in every step).
    kwargs: Dict[str, Any] = {"gradient_as_bucket_view": True, "static_graph": cfg_ddp.static_graph}
    if cfg_ddp.bucket_cap_mb is not None:  # passed at all, it also replaces torch's 1 MiB first bucket
        kwargs["bucket_cap_mb"] = cfg_ddp.bucket_cap_mb
    if not cfg_ddp.broadcast_buffers:
        kwargs[ddp_buffer_sync_argument()] = False
    comm_hook = None
    if cfg_ddp.grad_reduce.value == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
        comm_hook = bf16_compress_hook
    return DDPSpec(kwargs=kwargs, comm_hook=comm_hook)
