"""What the Trainer (trainer/trainer.py) builds a run from, beside its parts: the recipe, built and
checked for what the trainer reads from it; the model's positional inputs for executors that trace
it; the resolved config with what the run uses. ``build_recipe_alone``: the recipe for scripts that
need only its data or its model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
from omegaconf import OmegaConf

from graphing import Executor
from trainer.activation_checkpointing import apply_or_refuse as apply_activation_checkpointing
from trainer.data import extra_input_names, item_problem
from trainer.errors import ConfigError
from trainer.plan import RunPlan, plan_run
from trainer.recipe import Recipe
from trainer.runtime import Runtime
from trainer.step import model_call, model_call_arguments


def build_recipe_alone(cfg) -> Recipe:
    """The recipe ``cfg`` names (model and data), checked as a run would be, built for one
    process on the CPU with no process group: for scripts that need its data or its model only."""
    plan = plan_run(cfg, torch.device("cpu"), world_size=1)
    rt = Runtime(rank=0, local_rank=0, world_size=1, device=plan.device, distributed=False, run_dir=Path("."))
    return build_recipe(plan, rt)


def build_recipe(plan: RunPlan, rt: Runtime) -> Recipe:
    """The recipe the plan names, built and checked for what the trainer reads from it."""
    target = plan.cfg.recipe._target_
    recipe = plan.build_recipe(plan.cfg, rt)
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"recipe._target_={target} returned a {type(recipe).__name__}, not a "
                          "trainer.recipe.Recipe: see trainer/recipe.py for the contract")
    recipe = apply_activation_checkpointing(plan.cfg, recipe)
    if recipe.forward is not None and not callable(recipe.forward):
        raise ConfigError(f"recipe._target_={target} returned a Recipe whose forward is a "
                          f"{type(recipe.forward).__name__}: make it forward(model, batch) -> output, or None")
    for split, dataset in (("train", recipe.data.train), ("test", recipe.data.test)):
        problem = item_problem(dataset)
        if problem:
            raise ConfigError(
                f"recipe._target_={target} returned data the loaders cannot read: in its {split} split, {problem}. "
                'A dataset item is (x, y), or for a model with several inputs a dict {"x": ..., "y": ..., '
                "<input name>: ...} that Recipe.forward passes on (trainer/recipe.py, SplitLike): change the "
                "dataset's items to one of these")
        unread = extra_input_names(dataset) if recipe.forward is None else []
        if unread:
            raise ConfigError(
                f"recipe._target_={target} returned {split} data with the inputs {', '.join(map(repr, unread))} "
                "besides 'x' and 'y', but no Recipe.forward to pass them to the model (without one the model "
                "gets batch['x'] only): add forward=lambda model, batch: model(batch['x'], ...) to the Recipe, "
                "or drop those fields")
    return recipe


def positional_model_inputs(plan: RunPlan, model: torch.nn.Module, batch, recipe: Recipe) -> tuple:
    """The tensors the step passes the model for ``batch``, for executors that trace the model
    ahead of time (graph.mode=partial: torch.cuda.make_graphed_callables replays positional tensors)."""
    try:
        args, kwargs = model_call_arguments(model_call(recipe, plan.memory_format), model, batch)
    except ValueError:
        args, kwargs = None, {}
    if args is not None and not kwargs and all(torch.is_tensor(a) for a in args):
        return args
    how = ("never calls the model" if args is None
           else f"calls the model with keyword arguments ({', '.join(kwargs)})" if kwargs
           else "passes the model arguments that are not tensors")
    raise ConfigError(f"graph.mode=partial graphs the model with torch.cuda.make_graphed_callables, which replays "
                      f"tensors passed positionally, but the Recipe.forward of recipe._target_="
                      f"{plan.cfg.recipe._target_} {how}: pass the model tensors positionally in Recipe.forward, "
                      "or set graph=full (or graph=eager)")


def config_used(plan: RunPlan, recipe: Recipe, executor: Executor, rt: Runtime) -> Dict[str, Any]:
    """The resolved config, and beside each choice what this run actually uses."""
    config = OmegaConf.to_container(plan.cfg, resolve=True, enum_to_str=True)
    config["recipe"]["data"]["source_used"] = recipe.data.source
    config["recipe"]["data"]["loader_used"] = plan.loader
    config["graph"]["mode_used"] = plan.mode
    config["train"]["precision_used"] = plan.precision
    config["train"]["memory_format_used"] = str(plan.memory_format).replace("torch.", "")
    config["train"]["activation_checkpointing_used"] = recipe.activation_checkpointing
    config["graph"]["capture_error_mode_used"] = executor.report.capture_error_mode
    config["world_size"] = rt.world_size
    if plan.parallelism.sharded:
        config["train"]["fsdp"]["blocks_used"] = len(recipe.blocks)  # 0: the model sharded as one unit
    return config

