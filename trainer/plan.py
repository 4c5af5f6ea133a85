"""Every choice of a run, checked and resolved once, into one frozen ``RunPlan``.

``plan_run(cfg, device, world_size)`` runs before the ranks meet: types and choices were
checked by Hydra at compose time (conf/schema.py); here come ranges, combinations, the
machine, and whether the components named by ``_target_`` (recipe builder, optimizer
class, schedule class) can be imported and called. Choices that depend on the built
recipe (memory format, loader kind) are resolved by ``RunPlan.for_recipe``. Choices a
recipe owns (data sources, model options) are checked by the recipe when it is built,
and the settings only a recipe can apply (``recipe.label_smoothing``) against the Recipe
it returns (``RunPlan.build_recipe``).

Every setting is read or refused: one that this run cannot carry (a setting of another
mode, an option the recipe does not apply) stops the run here with a ConfigError naming it.
A concern with settings of its own checks them in its own module, and the plan calls it:
the optimizer and the schedule (trainer/step/optim.py ``optimizer_spec``, ``schedule_spec``),
the parallelism (trainer/parallel/parallelism.py ``plan_parallelism``: DDP's settings there, FSDP2's in
trainer/parallel/sharding.py ``fsdp_spec``), the graph (graphing's ``GraphOptions.resolved``, worded here as
``graph.*``).

The plan is what the rest of the run reads its choices from (the Trainer, trainer/trainer.py,
builds the run from it); plain values (epochs, intervals, paths) stay in ``plan.cfg``. How the
model is parallel is one of them, ``plan.parallelism``: whatever differs between DDP and FSDP2 (the
model's placement, the executor's DDP, the optimizer, the checkpoint format, the process group)
asks it, never the model. A new
choice (fp16 with a loss scaler, a set of input shapes to graph) is resolved here, once,
and read by the parts it concerns.
"""
from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict

import torch
from omegaconf import OmegaConf

from conf.schema import (CheckpointConfig, DataConfig, GraphConfig, LossScaleConfig, as_typed,
                         settings_the_user_changed)
from graphing import GraphConfigError, GraphMode, GraphOptions
from trainer.checkpoint import checkpoint_exists
from trainer.checkpoint.export import check_export_target, export_directory
from trainer.data import choose_loader, extra_input_names, item_problem
from trainer.data.workers import loader_workers
from trainer.run.errors import ConfigError
from trainer.recipe import Recipe
from trainer.step.activation_checkpointing import apply_or_refuse as apply_activation_checkpointing
from trainer.step.optim import OptimizerSpec, ScheduleSpec, check_captured_optimizer, optimizer_spec, schedule_spec
from trainer.parallel.parallelism import Parallelism, plan_parallelism
from trainer.run.targets import import_target


def graph_setting(name: str) -> str:
    """How this trainer's config names one of graphing's settings (messages name what to change)."""
    return {"eager_steps_before_capture": "graph.compare_steps",
            "doctor": "python scripts/doctor.py with this run's overrides"}.get(name, f"graph.{name}")


@dataclass(frozen=True)
class RunPlan:
    cfg: Any  # the composed config: plain values (epochs, intervals, paths) are read from it
    device: torch.device
    world_size: int
    graph: GraphOptions  # resolved: auto decided, checked for this machine
    precision: str  # fp32 | bf16 | fp16
    build_recipe: Callable  # build(cfg, runtime) -> trainer.recipe.Recipe, checked (recipe_builder)
    optimizer: OptimizerSpec
    schedule: ScheduleSpec
    parallelism: Parallelism  # train.parallel: replicated by DDP or sharded by FSDP2, asked by every part it concerns
    loader: str  # as asked (auto | device | host) until for_recipe resolves it
    num_workers: int  # recipe.data.num_workers resolved (null: this rank's share of the cores less one)
    memory_format: Any  # as asked ("auto", ...) until for_recipe resolves it to a torch.memory_format

    @property
    def mode(self) -> str:
        return self.graph.mode.value

    def for_recipe(self, recipe) -> "RunPlan":
        """This plan with the choices that depend on the built recipe resolved."""
        return replace(self, loader=choose_loader(self.loader, recipe.data.train, recipe.data.test, self.device),
                       memory_format=resolve_memory_format(self.memory_format, recipe.model, self.device))

    def config_used(self, recipe: Recipe, executor, world_size: int) -> Dict[str, Any]:
        """The resolved config, and beside each choice what this run (its ``executor``) actually uses."""
        config = OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
        config["recipe"]["data"]["source_used"] = recipe.data.source
        config["recipe"]["data"]["loader_used"] = self.loader
        config["recipe"]["data"]["num_workers_used"] = self.num_workers
        config["graph"]["mode_used"] = self.mode
        config["train"]["precision_used"] = self.precision
        config["train"]["memory_format_used"] = str(self.memory_format).replace("torch.", "")
        config["train"]["activation_checkpointing_used"] = recipe.activation_checkpointing
        config["graph"]["capture_error_mode_used"] = executor.report.capture_error_mode
        config["world_size"] = world_size
        if self.parallelism.sharded:
            config["train"]["fsdp"]["blocks_used"] = len(recipe.blocks)  # 0: the model sharded as one unit
        return config


def plan_run(cfg, device: torch.device, world_size: int) -> RunPlan:
    """Raises ConfigError naming the first setting that cannot work; else the run's plan."""
    _check_values(cfg)
    build_recipe, optimizer = recipe_builder(cfg), optimizer_spec(cfg.recipe.optim)
    precision = resolve_precision(cfg.train.precision.value, device)
    _check_loss_scale(cfg, precision)
    graph = graph_options(cfg, device, world_size)
    check_captured_optimizer(optimizer, captured=graph.mode is GraphMode.full)
    parallelism = plan_parallelism(cfg, device, world_size, precision, graph, optimizer.target, optimizer.cls)
    return RunPlan(cfg=cfg, device=device, world_size=world_size, graph=graph,
                   precision=precision, build_recipe=build_recipe, optimizer=optimizer,
                   schedule=schedule_spec(cfg.recipe.schedule), parallelism=parallelism,
                   loader=cfg.recipe.data.loader.value, num_workers=loader_workers(cfg.recipe.data.num_workers),
                   memory_format=cfg.train.memory_format.value)


def _check_values(cfg) -> None:
    t, d, c = cfg.train, cfg.recipe.data, cfg.checkpoint
    for key, value in (("train.epochs", t.epochs), ("train.log_every", t.log_every),
                       ("train.grad_accum", t.grad_accum), ("recipe.data.batch_size", d.batch_size),
                       ("recipe.data.eval_batch_size", d.eval_batch_size), ("checkpoint.keep", c.keep),
                       ("graph.compare_steps", cfg.graph.compare_steps)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1: set {key}=...")
    if t.stall_timeout_s is not None and t.stall_timeout_s < 1:
        raise ConfigError(f"train.stall_timeout_s={t.stall_timeout_s} must be at least 1 (seconds), or null to turn "
                          "the stall watchdog off")
    for key, value in (("train.grad_clip", t.grad_clip), ("checkpoint.every_steps", c.every_steps),
                       ("checkpoint.every_epochs", c.every_epochs), ("checkpoint.every_minutes", c.every_minutes),
                       ("recipe.data.num_workers", d.num_workers)):
        if value is not None and value < 0:
            raise ConfigError(f"{key}={value} must be >= 0 (0 turns it off)")
    if not 0 < d.worker_timeout_s < math.inf:
        raise ConfigError(f"recipe.data.worker_timeout_s={d.worker_timeout_s} must be a positive number of seconds: "
                          "set recipe.data.worker_timeout_s=300, say")
    smoothing = cfg.recipe.label_smoothing
    if not 0 <= smoothing < 1:  # at 1 the target is uniform: the labels would be ignored
        raise ConfigError(f"recipe.label_smoothing={smoothing} must be at least 0 and below 1 (0 turns it off): "
                          "set recipe.label_smoothing=0.1, say")
    if t.loss_scale.init <= 0 or t.loss_scale.growth_interval < 1:
        raise ConfigError(f"train.loss_scale.init={t.loss_scale.init} must be > 0 and train.loss_scale.growth_interval="
                          f"{t.loss_scale.growth_interval} at least 1")
    cap = t.ddp.bucket_cap_mb
    if cap is not None and not 0 < cap < math.inf:
        raise ConfigError(f"train.ddp.bucket_cap_mb={cap} must be a positive number of MiB: set "
                          "train.ddp.bucket_cap_mb=25 (say), or train.ddp.bucket_cap_mb=null for torch's default")
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"train.max_steps={t.max_steps} must be at least 1 (or null for whole epochs)")
    if c.resume not in ("auto", "never") and not checkpoint_exists(c.resume):
        raise ConfigError(f"checkpoint.resume={c.resume!r} is neither auto, never nor an existing checkpoint (a file, "
                          "or a sharded checkpoint's step_N.dcp directory): set checkpoint.resume=auto")
    if c.init_from is not None and not checkpoint_exists(c.init_from):
        raise ConfigError(f"checkpoint.init_from={c.init_from!r} is not a checkpoint: point it at one "
                          "(checkpoints/step_*.pt, step_*.dcp or best.pt of a run), or drop checkpoint.init_from")
    if c.export is not None:  # an existing one only if it may be this run's own (decided once it has resumed)
        # run_dir=null is a new directory, except under a torchrun job, whose restart finds the job's (runtime.py)
        restart = os.environ.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none")
        check_export_target(export_directory(c.export), Path(cfg.run_dir) if cfg.run_dir else None,
                            may_be_this_run=restart)
    if not c.save and c.best_metric is not None:
        raise ConfigError(f"checkpoint.best_metric={c.best_metric} writes best.pt, but checkpoint.save=false writes "
                          "no checkpoint: drop checkpoint.best_metric, or set checkpoint.save=true")
    if c.best_metric == "eval/accuracy" and not cfg.recipe.accuracy:
        raise ConfigError("checkpoint.best_metric=eval/accuracy needs the accuracy, but recipe.accuracy=false: set "
                          "checkpoint.best_metric=eval/loss, or recipe.accuracy=true")
    if c.best_metric is not None and not (c.best_metric.startswith("eval/") and t.eval):
        raise ConfigError(f"checkpoint.best_metric={c.best_metric!r}: name an evaluation metric (eval/accuracy, "
                          "eval/loss) and keep train.eval=true")
    _refuse_unread(cfg, "checkpoint", CheckpointConfig, ("export_dtype",), read=c.export is not None,
                   needs="checkpoint.export", fix="checkpoint.export=<a new directory>")
    _refuse_unread(cfg, "checkpoint", CheckpointConfig, ("every_steps", "every_epochs", "every_minutes"), read=c.save,
                   needs="checkpoint.save=true", fix="checkpoint.save=true")
    _refuse_unread(cfg, "recipe.data", DataConfig, ("worker_start", "worker_timeout_s"), read=d.num_workers != 0,
                   needs="recipe.data.num_workers above 0, or null (DataLoader workers)", fix="recipe.data.num_workers=2")


def _refuse_unread(cfg, path: str, defaults, keys, read: bool, needs: str, fix: str) -> None:
    """Refuses a setting of ``keys`` (under ``path``) that only matters beside another, where that other says it is
    not read: only when the user set it (a recipe's or an experiment's preset is not refused), and not to a value
    that turns it off (0, false), which agrees with it being unread."""
    if read:
        return
    changed = settings_the_user_changed(cfg, path, defaults)
    for key in keys:
        value = changed.get(key)
        if value:
            raise ConfigError(f"{path}.{key}={as_typed(value)} is read only with {needs}, which this run does not set: "
                              f"set {fix}, or drop {path}.{key}")


def resolve_precision(setting: str, device: torch.device) -> str:
    """``train.precision`` as fp32, bf16 or fp16 (auto: bf16 on CUDA, where it is fast; fp32 on the CPU)."""
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if setting == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs a CUDA GPU: float16 autocast with a loss scale is for GPUs "
                          "without fast bf16 (T4, V100), and the CPU has no float16 autocast to speak of; set "
                          "train.precision=bf16 or fp32 here")
    return setting


def _check_loss_scale(cfg, precision: str) -> None:
    """``train.loss_scale`` is fp16's: set for another precision, it is refused, naming the key."""
    if precision == "fp16":
        return
    train = cfg.train
    for key, value in settings_the_user_changed(cfg, "train.loss_scale", LossScaleConfig).items():
        raise ConfigError(f"train.loss_scale.{key}={value:g} applies to train.precision=fp16 only, but this run "
                          f"trains in {precision} (train.precision={train.precision.value}): set "
                          f"train.precision=fp16, or drop train.loss_scale.{key}")


def resolve_memory_format(setting: str, model: torch.nn.Module, device: torch.device) -> torch.memory_format:
    """``train.memory_format`` as a torch memory format (auto: channels_last for conv nets on CUDA)."""
    if setting == "auto":
        has_conv = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
        setting = "channels_last" if has_conv and device.type == "cuda" else "contiguous"
    return torch.channels_last if setting == "channels_last" else torch.contiguous_format


def recipe_builder(cfg) -> Callable:
    """The callable ``recipe._target_`` names, ``build(cfg, runtime) -> Recipe``, as a builder
    whose Recipe is checked for the settings only a recipe can apply (``check_recipe_applies``)."""
    build = import_target(cfg.recipe._target_, "recipe._target_", "recipes.mnist.build")
    try:
        inspect.signature(build).bind(cfg, None)
    except (TypeError, ValueError):  # not callable, or not with (cfg, runtime)
        raise ConfigError(f"recipe._target_={cfg.recipe._target_} cannot be called as build(cfg, runtime): name a "
                          "function build(cfg, runtime) -> trainer.recipe.Recipe") from None
    return partial(_build_checked, build)


def _build_checked(build: Callable, cfg, rt) -> Recipe:
    """``build(cfg, rt)``, the Recipe it returns checked for what the trainer reads from it, with
    activation checkpointing applied (``RunPlan.build_recipe``)."""
    target = cfg.recipe._target_
    recipe = build(cfg, rt)
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"recipe._target_={target} returned a {type(recipe).__name__}, not a "
                          "trainer.recipe.Recipe: see trainer/recipe.py for the contract")
    check_recipe_applies(cfg, recipe)
    if cfg.checkpoint.export is not None and recipe.export is None:
        raise ConfigError(f"checkpoint.export={cfg.checkpoint.export!r}: recipe {recipe.name!r} cannot write its model "
                          "in a library's format (its Recipe gives no export; recipe=hf_causal_lm does): drop "
                          "checkpoint.export, and use its checkpoints")
    recipe = apply_activation_checkpointing(cfg, recipe)
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


def check_recipe_applies(cfg, recipe: Recipe) -> None:
    """Refuses ``recipe.label_smoothing`` unless the Recipe says that its criterion applies that value."""
    asked, applied = float(cfg.recipe.label_smoothing), float(recipe.label_smoothing)
    if asked == applied:
        return
    says = ("does not apply label smoothing (its Recipe says label_smoothing=0)" if applied == 0 else
            f"applies {applied:g} instead (its Recipe says label_smoothing={applied:g})")
    raise ConfigError(
        f"recipe.label_smoothing={asked:g}: recipe {recipe.name!r} (recipe._target_={cfg.recipe._target_}) {says}. "
        f"Set recipe.label_smoothing={applied:g}, or choose a recipe that supports it; a recipe of your own "
        "supports it by passing cfg.recipe.label_smoothing to its loss (F.cross_entropy(..., label_smoothing=)) "
        "and returning Recipe(..., label_smoothing=cfg.recipe.label_smoothing)")


def graph_options(cfg, device: torch.device, world_size: int) -> GraphOptions:
    """``cfg.graph`` as graphing's options, resolved for this machine (``auto`` decided)."""
    g = cfg.graph
    try:
        options = GraphOptions(mode=g.mode, warmup_iters=g.warmup_iters, capture_error_mode=g.capture_error_mode,
                               on_failure=g.on_failure, compile_model=g.compile_model, compile_mode=g.compile_mode,
                               eager_steps_before_capture=g.compare_steps if g.compare else 0,
                               max_graphs=g.max_graphs, shape_warmup_iters=g.shape_warmup_iters)
        options = options.resolved(device.type, world_size, torch.cuda.is_available())
    except GraphConfigError as e:
        raise ConfigError(e.render(graph_setting)) from None
    _refuse_unread(cfg, "graph", GraphConfig, ("compare_steps",), read=g.compare, needs="graph.compare=true",
                   fix="graph.compare=true (experiment=compare)")
    if g.compare and options.mode is not GraphMode.full:
        raise ConfigError(f"graph.compare=true times eager steps against full-graph steps, but graph.mode "
                          f"resolves to {options.mode.value} here: set graph=full on a GPU (or drop graph.compare)")
    return options
