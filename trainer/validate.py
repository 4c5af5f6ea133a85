"""Every check on the config that needs more than a type, in one place, before the ranks meet.

Types and choices (Enums) are checked by Hydra at compose time (conf/schema.py). What is
left: ranges, combinations, the machine, and whether the components named by
``_target_`` can be imported. Choices a recipe owns (data sources, model options) are
checked by the recipe when it is built.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable

import torch

from graphing import GraphConfigError, GraphOptions
from trainer.errors import ConfigError
from trainer.optim import optimizer_class
from trainer.targets import import_target


def check_config(cfg) -> None:
    """Raises ConfigError naming the first setting that cannot work."""
    t, d, c = cfg.train, cfg.recipe.data, cfg.checkpoint
    for key, value in (("train.epochs", t.epochs), ("train.log_every", t.log_every),
                       ("train.grad_accum", t.grad_accum), ("recipe.data.batch_size", d.batch_size),
                       ("recipe.data.eval_batch_size", d.eval_batch_size), ("checkpoint.keep", c.keep),
                       ("graph.compare_steps", cfg.graph.compare_steps)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1: set {key}=...")
    for key, value in (("train.grad_clip", t.grad_clip), ("checkpoint.every_steps", c.every_steps),
                       ("checkpoint.every_epochs", c.every_epochs), ("checkpoint.every_minutes", c.every_minutes),
                       ("recipe.data.num_workers", d.num_workers), ("recipe.label_smoothing", cfg.recipe.label_smoothing)):
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0 (0 turns it off)")
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"train.max_steps={t.max_steps} must be at least 1 (or null for whole epochs)")
    if c.resume not in ("auto", "never") and not Path(c.resume).is_file():
        raise ConfigError(f"checkpoint.resume={c.resume!r} is neither auto, never nor an existing file: "
                          "set checkpoint.resume=auto")
    if c.init_from is not None and not Path(c.init_from).is_file():
        raise ConfigError(f"checkpoint.init_from={c.init_from!r} is not a file: point it at a checkpoint "
                          "(checkpoints/step_*.pt or best.pt of a run), or drop it")
    if c.best_metric is not None and not (c.best_metric.startswith("eval/") and t.eval):
        raise ConfigError(f"checkpoint.best_metric={c.best_metric!r}: name an evaluation metric (eval/accuracy, "
                          "eval/loss) and keep train.eval=true")
    recipe_builder(cfg)
    optimizer_class(cfg.recipe.optim)


def recipe_builder(cfg) -> Callable:
    """The callable ``recipe._target_`` names: ``build(cfg, runtime) -> Recipe``."""
    build = import_target(cfg.recipe._target_, "recipe._target_", "recipes.mnist.build")
    try:
        inspect.signature(build).bind(cfg, None)
    except (TypeError, ValueError):  # not callable, or not with (cfg, runtime)
        raise ConfigError(f"recipe._target_={cfg.recipe._target_} cannot be called as build(cfg, runtime): name a "
                          "function build(cfg, runtime) -> trainer.recipe.Recipe") from None
    return build


def graph_options(cfg, device: torch.device, world_size: int) -> GraphOptions:
    """``cfg.graph`` as graphing's options, resolved for this machine (``auto`` decided)."""
    g = cfg.graph
    try:
        options = GraphOptions(mode=g.mode, warmup_iters=g.warmup_iters, capture_error_mode=g.capture_error_mode,
                               on_failure=g.on_failure, compile_model=g.compile_model,
                               eager_steps_before_capture=g.compare_steps if g.compare else 0,
                               setting_prefix="graph.")
        options = options.resolved(device.type, world_size, torch.cuda.is_available())
    except GraphConfigError as e:
        raise ConfigError(str(e)) from None
    if g.compare and options.mode != "full":
        raise ConfigError(f"graph.compare=true times eager steps against full-graph steps, but graph.mode "
                          f"resolves to {options.mode} here: set graph=full on a GPU (or drop graph.compare)")
    return options
