"""Builds the parts of one run from its plan, in one place, for train.py and every script.

``build_run(plan, rt)``: the recipe (model, data, loss), the model on its device in
its memory format, the loaders, the executor for the graph mode, the graph-safe
optimizer and device-side schedule, the train and eval steps, the performance
counters and the checkpointable state. Nothing is restored here: resuming is the
session's next step (``TrainingState.resume``), before any warm-up or capture.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import OmegaConf

from graphing import Executor, GraphMode, build_executor
from graphing.executor import log_fallback
from trainer.activation_checkpointing import apply_or_refuse as apply_activation_checkpointing
from trainer.data import extra_input_names, item_problem, make_loader
from trainer.errors import ConfigError
from trainer.optim import build_optimizer, build_schedule
from trainer.perf import Perf
from trainer.plan import RunPlan, graph_setting, plan_run
from trainer.recipe import Recipe
from trainer.runtime import Runtime, seed_rank_streams
from trainer.schedules import LRSchedule
from trainer.seq_len import SeqLenSchedule, seq_len_schedule
from trainer.sharding import sharded_model
from trainer.state import TrainingState
from trainer.step import (EvalStep, StepSettings, TrainStep, autocast_factory, build_step_model, model_call,
                          model_call_arguments)


@dataclass
class Run:
    """The parts of one run. ``raw_model`` is what checkpoints hold, whatever wraps it
    (DDP, compile, graphs); ``model`` is what the training step calls."""
    plan: RunPlan  # resolved for the recipe (loader, memory format)
    rt: Runtime
    recipe: Recipe
    raw_model: torch.nn.Module
    model: torch.nn.Module
    executor: Executor
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    train_loader: Any
    eval_loader: Any
    train_step: TrainStep
    eval_step: EvalStep
    perf: Perf
    state: TrainingState
    config: Dict[str, Any]  # the resolved config, with what this run actually uses beside what was asked
    steps_per_epoch: int
    total_steps: int
    seq_lens: Optional[SeqLenSchedule]  # recipe.data.seq_len_buckets: each step's sequence length
    global_batch: int

    def close(self) -> None:
        """Releases graphs (before the process group goes) and the loaders' workers."""
        self.executor.close()
        self.train_loader.close()
        self.eval_loader.close()


def build_run(plan: RunPlan, rt: Runtime) -> Run:
    cfg = plan.cfg
    loop, data_cfg = cfg.train, cfg.recipe.data
    recipe = _recipe(plan, rt)
    plan = plan.for_recipe(recipe)
    device = plan.device
    if plan.fsdp is None:
        model = recipe.model.to(device, memory_format=plan.memory_format)
    else:  # each block and the root sharded over all ranks (before seed_rank_streams: a meta init draws alike)
        model = sharded_model(recipe, device, plan.fsdp, plan.precision)
    seed_rank_streams(cfg.seed, rt.rank)  # the model is built alike on every rank; the step's draws differ
    train_loader = make_loader(recipe.data.train, data_cfg.batch_size, rt, kind=plan.loader, train=True,
                               seed=cfg.seed, batches_per_step=loop.grad_accum, num_workers=data_cfg.num_workers,
                               drop_last=data_cfg.drop_last)
    eval_loader = make_loader(recipe.data.test, data_cfg.eval_batch_size, rt, kind=plan.loader, train=False,
                              seed=cfg.seed, num_workers=data_cfg.num_workers)
    steps_per_epoch = train_loader.steps
    total_steps = loop.epochs * steps_per_epoch
    if loop.max_steps:
        total_steps = min(total_steps, loop.max_steps)
    seq_lens = seq_len_schedule(data_cfg.seq_len_buckets, unit=recipe.unit, context=recipe.units_per_sample,
                                total_steps=total_steps, recipe=recipe.name, max_graphs=plan.graph.max_graphs,
                                shapes_per_bucket=1 + (train_loader.plan.tail is not None),
                                graphed=plan.graph.mode is GraphMode.full)
    executor = build_executor(plan.graph, device, ddp_kwargs=plan.ddp.kwargs, comm_hook=plan.ddp.comm_hook,
                              on_fallback=partial(log_fallback, name=graph_setting))  # in this trainer's words
    optimizer = build_optimizer(plan.optimizer, model.parameters(), device, captured=executor.captures_optimizer,
                                loss_scaled=plan.precision == "fp16", sharded=plan.fsdp is not None)
    scaler = None
    if plan.precision == "fp16":
        scaler = torch.amp.GradScaler(device.type, init_scale=loop.loss_scale.init,
                                      growth_interval=loop.loss_scale.growth_interval)
    schedule = build_schedule(plan.schedule, plan.optimizer.lr, total_steps)
    autocast = autocast_factory(plan.precision, device)

    def sample_inputs():  # the model's inputs for one preprocessed training batch, for executors that trace it
        train_loader.stage()
        inputs = positional_model_inputs(plan, model, recipe.preprocess(train_loader.next_batch(), True), recipe)
        train_loader.start_epoch(0)
        return inputs

    settings = StepSettings(device=device, grad_accum=loop.grad_accum, grad_clip=loop.grad_clip, autocast=autocast,
                            world_size=rt.world_size)
    # What the step computes, chosen once: under graph.compile_model the model is compiled with its loss,
    # or, sharded, block by block with the loss apart (graphing/full.py compile_sharded_units).
    step_model = build_step_model(recipe, model, executor, settings,
                                  with_loss=plan.graph.compile_model and plan.fsdp is None,
                                  memory_format=plan.memory_format, sample_inputs=sample_inputs,
                                  accuracy=cfg.recipe.accuracy)
    train_step = TrainStep(recipe, step_model, optimizer, schedule, train_loader, settings, scaler)
    eval_step = EvalStep(recipe, step_model, eval_loader, settings)
    global_batch = data_cfg.batch_size * loop.grad_accum * rt.world_size
    perf = Perf(device, units_per_step=global_batch * recipe.units_per_sample, unit=recipe.unit,
                world_size=rt.world_size, flops_per_unit=recipe.flops_per_unit, precision=plan.precision,
                units_per_sample=recipe.units_per_sample)
    config = _config_used(plan, recipe, executor, rt)
    state = TrainingState(rt, model=model, optimizer=optimizer, step_counter=train_step.step, scaler=scaler,
                          recipe_name=recipe.name, config=config, seed=cfg.seed, keep=cfg.checkpoint.keep,
                          steps_per_epoch=steps_per_epoch)
    return Run(plan=plan, rt=rt, recipe=recipe, raw_model=model, model=step_model.module, executor=executor,
               optimizer=optimizer, schedule=schedule, train_loader=train_loader, eval_loader=eval_loader,
               train_step=train_step, eval_step=eval_step, perf=perf, state=state, config=config,
               steps_per_epoch=steps_per_epoch, total_steps=total_steps, seq_lens=seq_lens,
               global_batch=global_batch)


def build_recipe_alone(cfg) -> Recipe:
    """The recipe ``cfg`` names (model and data), checked as a run would be, built for one
    process on the CPU with no process group: for scripts that need its data or its model only."""
    plan = plan_run(cfg, torch.device("cpu"), world_size=1)
    rt = Runtime(rank=0, local_rank=0, world_size=1, device=plan.device, distributed=False, run_dir=Path("."))
    return _recipe(plan, rt)


def _recipe(plan: RunPlan, rt: Runtime) -> Recipe:
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


def _config_used(plan: RunPlan, recipe: Recipe, executor: Executor, rt: Runtime) -> Dict[str, Any]:
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
    if plan.fsdp is not None:
        config["train"]["fsdp"]["blocks_used"] = len(recipe.blocks)  # 0: the model sharded as one unit
    return config

