"""``train.float8``: the matmuls of a model's Linear layers in float8, through torchao.

Which layers (one rule, docs/float8.md): the ``nn.Linear`` layers inside the recipe's repeated
blocks (``Recipe.blocks``) whose two sizes both divide by 16 (what float8 matmuls take) and whose
weight no other module shares. Everything else stays in the run's precision: embeddings, the output
head (tied to an embedding or not), norms, a classifier, any layer outside the blocks. A recipe with
no such layer (mnist, cifar10_resnet18) is refused by name.

What float8 changes: each converted matmul casts its input and weight (and in backward the output's
gradient) to float8 with a scale from their absolute maximum (``tensorwise``: one scale a tensor;
``rowwise``: one a row), multiplies in float8 and returns the run's precision. The weights
themselves stay the high-precision tensors they were, so a checkpoint holds the same tensors with
float8 or without and resumes either way.

``train.fsdp.float8_all_gather`` (``tensorwise`` under fsdp2): FSDP2 all-gathers each weight already
cast to float8, half of bf16's bytes. The cast needs the whole weight's absolute maximum: torchao
computes it for every converted weight in one all-reduce (``precompute_float8_dynamic_scale_for_fsdp``),
which the step runs first, before its forward (``Float8Spec.step_hooks``), inside the captured
step, then casts each weight once for the step's two gathers (trainer/parallel/float8_cast.py).
Not after the optimizer (torchtitan's place): torchao assigns a new scale tensor on each call, so
a CUDA graph captured with the call at its end replays a forward that reads the scales of the last
eager step forever (graphing refuses that order in a user's step, graphing/float8_scales.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Iterable, List, Optional, Tuple

import torch

from trainer.parallel.float8_cast import TESTED_TORCHAO, WeightCasts
from trainer.run.errors import ConfigError

INSTALL = "pip install -r requirements-float8.txt"
# float8 matmuls (torch._scaled_mm) run on compute capability 8.9 and newer: H100, H200, L4, RTX 40xx
LEAST_CAPABILITY = (8, 9)
SIZE_MULTIPLE = 16  # both sizes of a float8 matmul's weight
StepHook = Optional[Callable[[], None]]  # what a step runs first or last (None: nothing)


@dataclass(frozen=True)
class Float8Spec:
    """``train.float8`` resolved: torchao's recipe, FSDP2's float8 all-gather, and torchao's emulation
    (``train.float8_emulate``: plain matmuls of float8-rounded values, for CPU tests)."""
    recipe: str
    all_gather: bool
    emulate: bool
    compiled: bool  # graph.compile_model: float8 pays with compile only (its casts fused into the matmuls' neighbours)

    def describe(self, layers: int, precision: str) -> str:
        """One line for the console: what is converted, and when float8 cannot pay."""
        said = (f"float8 ({self.recipe}{', emulated' if self.emulate else ''}"
                f"{', float8 all-gather' if self.all_gather else ''}): {layers} Linear layers of the recipe's blocks; "
                f"the rest in {precision}")
        if not self.compiled and not self.emulate:
            said += (". WARNING: without graph.compile_model float8's casts and scales run as kernels of their own, "
                     "slower than bf16 (docs/float8.md): set graph=full_compiled")
        return said

    def convert(self, model: torch.nn.Module, blocks: Iterable[torch.nn.Module], recipe_name: str) -> List[str]:
        """Converts, in place, the Linear layers the rule takes (before sharding and before the optimizer is
        built: with the all-gather, torchao wraps each weight in a new Parameter); returns their names."""
        Float8LinearConfig, convert_to_float8_training = _torchao("Float8LinearConfig", "convert_to_float8_training")

        chosen = {id(m): name for name, m in float8_layers(model, blocks)}
        if not chosen:
            raise ConfigError(
                f"train.float8={self.recipe}: recipe {recipe_name!r} has no Linear layer float8 can take (float8 "
                f"converts the nn.Linear layers inside Recipe.blocks whose sizes both divide by {SIZE_MULTIPLE}; "
                "docs/float8.md): set train.float8=none")
        config = replace(Float8LinearConfig.from_recipe_name(self.recipe),
                         enable_fsdp_float8_all_gather=self.all_gather, emulate=self.emulate)
        convert_to_float8_training(model, module_filter_fn=lambda module, _fqn: id(module) in chosen, config=config)
        return sorted(chosen.values())

    def step_hooks(self, model: torch.nn.Module) -> Tuple[StepHook, StepHook]:
        """What a step runs first and last (None: nothing). With FSDP2's float8 all-gather: first the weights'
        float8 scales from the weights as they are now (one all-reduce), then each weight cast with its scale once
        for the step's gathers; last, those casts dropped (trainer/parallel/float8_cast.py). Without the all-gather
        each cast finds its own scale. A torchao whose weight wrapper is not the one the casts read gathers through
        torchao's own cast, with the scales, said once."""
        if not self.all_gather:
            return None, None
        (precompute,) = _torchao("precompute_float8_dynamic_scale_for_fsdp")
        casts = WeightCasts(model, compiled=self.compiled)
        differs = casts.surface_differs()
        if differs is not None:
            from trainer.run.runtime import print_once

            print_once(f"WARNING: train.fsdp.float8_all_gather: {differs}, which the cast once a step reads "
                       "(trainer/parallel/float8_cast.py): each all-gather casts its weight itself, as torchao does "
                       f"(the same bytes, slower; docs/float8.md). For the cast once a step: {INSTALL}")
            return partial(precompute, model), None
        return partial(_scales_then_casts, partial(precompute, model), casts), casts.drop


def _scales_then_casts(scales: Callable[[], None], casts: Callable[[], None]) -> None:
    scales()
    casts()


def float8_layers(model: torch.nn.Module, blocks: Iterable[torch.nn.Module]) -> List[tuple]:
    """``(name, module)`` of each Linear layer the rule converts (the module docstring's rule)."""
    uses = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    inside = {id(m) for block in blocks for m in block.modules()}
    return [(name, m) for name, m in model.named_modules()
            if id(m) in inside and type(m) is torch.nn.Linear
            and m.in_features % SIZE_MULTIPLE == 0 and m.out_features % SIZE_MULTIPLE == 0
            and uses[id(m.weight)] == 1]


def float8_spec(cfg, device: torch.device, precision: str, compiled: bool) -> Optional[Float8Spec]:
    """``train.float8`` and its settings, checked for the plan: torchao present (said first), the machine,
    the precision, the all-gather's recipe. None for ``train.float8=none``."""
    t = cfg.train
    recipe = t.float8.value
    all_gather = bool(t.fsdp.float8_all_gather)
    if recipe == "none":
        if all_gather:
            raise ConfigError("train.fsdp.float8_all_gather=true gathers float8 weights, but train.float8=none: set "
                              "train.float8=tensorwise, or drop train.fsdp.float8_all_gather")
        if t.float8_emulate:
            raise ConfigError("train.float8_emulate=true emulates float8 matmuls, but train.float8=none: set "
                              "train.float8=tensorwise (or rowwise), or drop train.float8_emulate")
        return None
    try:
        _torchao()
    except ImportError:
        raise ConfigError(f"train.float8={recipe} trains through torchao, which is not installed: {INSTALL} "
                          f"(torchao{TESTED_TORCHAO}), or set train.float8=none") from None
    if t.float8_emulate:
        if compiled:
            raise ConfigError("train.float8_emulate=true is torchao's emulation for tests, eager only: drop "
                              "graph.compile_model (graph=full or eager), or train.float8_emulate")
    elif device.type != "cuda":
        raise ConfigError(f"train.float8={recipe} needs a CUDA GPU of compute capability 8.9 or newer (H100, H200, "
                          f"L4, RTX 40xx), and this run is on {device.type}: set train.float8=none "
                          "(train.float8_emulate=true emulates it, slowly, for tests)")
    else:
        capability = torch.cuda.get_device_capability(device)
        if capability < LEAST_CAPABILITY:
            raise ConfigError(f"train.float8={recipe} needs compute capability 8.9 or newer (H100, H200, L4, RTX "
                              f"40xx), and {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
                              "set train.float8=none")
    if precision == "fp16":
        raise ConfigError(f"train.float8={recipe} with train.precision=fp16: float8 casts scale each tensor by its "
                          "own maximum, which fp16's loss scale would then scale again; set train.precision=bf16")
    if all_gather and recipe != "tensorwise":
        raise ConfigError(f"train.fsdp.float8_all_gather=true gathers weights with one scale each, which "
                          f"train.float8={recipe} does not use: set train.float8=tensorwise, or drop "
                          "train.fsdp.float8_all_gather")
    return Float8Spec(recipe=recipe, all_gather=all_gather, emulate=bool(t.float8_emulate), compiled=compiled)


def _torchao(*names: str) -> tuple:
    """``torchao.float8``'s ``names``, imported without torch's pytree deprecation lines."""
    from trainer.run.process import quiet_pytree_registrations

    with quiet_pytree_registrations():
        import torchao.float8 as float8
    return tuple(getattr(float8, name) for name in names)
