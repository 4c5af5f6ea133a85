"""The Trainer: one run, built once from its plan, that fits, runs one step at a time, and closes.

    trainer = Trainer(plan, rt)        # recipe, model (sharded, wrapped), executor, optimizer, loaders, steps
    start, run_id = trainer.resume(cfg.checkpoint)   # before any warm-up or capture
    summary = trainer.fit(logger, start)             # epochs of steps; logs, checkpoints, evaluates
    trainer.close()                                  # graphs and loaders, before the process group goes

train.py's run (trainer/session.py) and every script build it the same way, through the
session (trainer/session.py ``Session.build``). One step driver, ``run_step``: fit runs it, and scripts
time it through ``next_step``, each step in the shape fit gives it (full, the epoch's tail, a
recipe.data.seq_len_buckets length).

Per step the host only stages inputs, runs the step (eagerly or by graph replay, as the executor
decides: trainer/step/steps.py ``TrainStep`` is what runs) and records a timing event. It reads device
values only when the log policy says so; when to checkpoint and evaluate is asked of the policies
in trainer/policies.py, when to stop early of the ranks' agreement (trainer/run/stop.py).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections import deque
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from graphing import GraphMode, StepRole, build_executor, weights_digest
from graphing.executor import log_fallback
from trainer.run import hooks
from trainer.checkpoint import TrainingState
from trainer.data import StepShape, make_loader
from trainer.data.workers import WorkerSettings, use_worker_settings
from trainer.run.errors import NonFiniteLossError, Preempted
from trainer.metrics.logger import MetricsLogger
from trainer.step.optim import build_optimizer, build_schedule
from trainer.metrics.perf import Perf, peak_host_mib
from trainer.plan import RunPlan, graph_setting
from trainer.policies import CheckpointPolicy, EvalPolicy, LogPolicy, StepPoint
from trainer.run.process import process_started_at, under_torchrun
from trainer.metrics.progress import close_bar, progress_bar, show_on_bar
from trainer.run.runtime import Runtime, print_once, seed_rank_streams
from trainer.step.seq_len import seq_len_schedule
from trainer.step.steps import (EvalStep, StepSettings, TrainStep, autocast_factory, build_step_model,
                                positional_model_inputs)
from trainer.run.stop import StopAgreement
from trainer.run.watchdog import EVALUATION, StallWatchdog

log = logging.getLogger("train")

HISTORY_ROWS = 1000  # logged rows kept in memory (for tests and scripts); metrics.jsonl has them all


class Trainer:
    """One run's parts and its loop. ``raw_model`` is what checkpoints hold, whatever wraps it (DDP,
    compile, graphs); ``model`` is what the training step calls; ``state`` what is saved and resumed.
    Nothing is restored while building: ``resume`` does that, before any warm-up or capture."""

    def __init__(self, plan: RunPlan, rt: Runtime):
        cfg = plan.cfg
        train_cfg, data_cfg = cfg.train, cfg.recipe.data
        use_worker_settings(WorkerSettings(data_cfg.worker_start.value, data_cfg.worker_timeout_s),
                            start_now_for=cfg.recipe._target_.rpartition(".")[0] if plan.num_workers else None)
        recipe = plan.build_recipe(cfg, rt)
        plan = plan.for_recipe(recipe)
        device, parallelism = plan.device, plan.parallelism
        # Before seed_rank_streams: a sharded model's meta init draws alike on every rank.
        model = parallelism.place_model(recipe, device, plan.precision, plan.memory_format)
        seed_rank_streams(cfg.seed, rt.rank)  # the model is built alike on every rank; the step's draws differ
        train_loader = make_loader(recipe.data.train, data_cfg.batch_size, rt, kind=plan.loader, train=True,
                                   seed=cfg.seed, batches_per_step=train_cfg.grad_accum, num_workers=plan.num_workers,
                                   drop_last=data_cfg.drop_last)
        eval_loader = make_loader(recipe.data.test, data_cfg.eval_batch_size, rt, kind=plan.loader, train=False,
                                  seed=cfg.seed, num_workers=plan.num_workers)
        steps_per_epoch = train_loader.steps
        total_steps = train_cfg.epochs * steps_per_epoch
        if train_cfg.max_steps:
            total_steps = min(total_steps, train_cfg.max_steps)
        seq_lens = seq_len_schedule(data_cfg.seq_len_buckets, unit=recipe.unit, context=recipe.units_per_sample,
                                    total_steps=total_steps, recipe=recipe.name, max_graphs=plan.graph.max_graphs,
                                    shapes_per_bucket=1 + (train_loader.shapes.tail is not None),
                                    graphed=plan.graph.mode is GraphMode.full)
        executor = build_executor(plan.graph, device, **parallelism.executor_arguments,
                                  on_fallback=partial(log_fallback, name=graph_setting))  # in this trainer's words
        optimizer = build_optimizer(plan.optimizer, model.parameters(), device, captured=executor.captures_optimizer,
                                    loss_scaled=plan.precision == "fp16", sharded=parallelism.sharded)
        scaler = None
        if plan.precision == "fp16":
            scaler = torch.amp.GradScaler(device.type, init_scale=train_cfg.loss_scale.init,
                                          growth_interval=train_cfg.loss_scale.growth_interval)
        schedule = build_schedule(plan.schedule, plan.optimizer.lr, total_steps)
        autocast = autocast_factory(plan.precision, device)

        def sample_inputs():  # the model's inputs for one preprocessed training batch, for executors that trace it
            train_loader.stage()
            inputs = positional_model_inputs(recipe, plan.memory_format, model,
                                             recipe.preprocess(train_loader.next_batch(), True), cfg.recipe._target_)
            train_loader.start_epoch(0)
            return inputs

        first_in_step, last_in_step = parallelism.step_hooks(model)
        settings = StepSettings(device=device, grad_accum=train_cfg.grad_accum, grad_clip=train_cfg.grad_clip,
                                autocast=autocast, world_size=rt.world_size, first_in_step=first_in_step,
                                last_in_step=last_in_step)
        # What the step computes, chosen once: under graph.compile_model the model is compiled with its loss,
        # or, sharded, block by block with the loss apart (Parallelism.compile_with_loss); compiled either way,
        # the training accuracy is counted in the loss's kernels (no pass of its own over the logits).
        step_model = build_step_model(recipe, model, executor, settings,
                                      with_loss=parallelism.compile_with_loss(plan.graph),
                                      memory_format=plan.memory_format, sample_inputs=sample_inputs,
                                      accuracy=cfg.recipe.accuracy, count_with_loss=plan.graph.compile_model)
        train_step = TrainStep(recipe, step_model, optimizer, schedule, train_loader, settings, scaler)
        eval_step = EvalStep(recipe, step_model, eval_loader, settings)
        global_batch = data_cfg.batch_size * train_cfg.grad_accum * rt.world_size
        perf = Perf(device, units_per_step=global_batch * recipe.units_per_sample, unit=recipe.unit,
                    world_size=rt.world_size, flops_per_unit=recipe.flops_per_unit, precision=plan.precision,
                    units_per_sample=recipe.units_per_sample,
                    padding_fraction=recipe.data.stats.get("data/padding_fraction"))
        config = plan.config_used(recipe, executor, rt.world_size)
        state = TrainingState(rt, model=model, parallelism=parallelism, optimizer=optimizer,
                              step_counter=train_step.step, scaler=scaler, recipe_name=recipe.name, config=config,
                              seed=cfg.seed, keep=cfg.checkpoint.keep, steps_per_epoch=steps_per_epoch)
        self.plan, self.rt, self.cfg, self.device = plan, rt, cfg, device  # plan: resolved for the recipe
        self.recipe, self.raw_model, self.model, self.executor = recipe, model, step_model.module, executor
        self.optimizer, self.schedule, self.train_step, self.eval_step = optimizer, schedule, train_step, eval_step
        self.train_loader, self.eval_loader, self.perf, self.state = train_loader, eval_loader, perf, state
        self.config = config  # the resolved config, with what this run actually uses beside what was asked
        self.steps_per_epoch, self.total_steps, self.global_batch = steps_per_epoch, total_steps, global_batch
        self.seq_lens = seq_lens  # recipe.data.seq_len_buckets: each step's sequence length, or None
        # The loop's own state.
        self.logs = LogPolicy(train_cfg.log_every)
        self.checkpoints = CheckpointPolicy(cfg.checkpoint.every_steps, cfg.checkpoint.every_epochs,
                                            cfg.checkpoint.every_minutes, rt.is_main, cfg.checkpoint.save)
        self.evaluations = EvalPolicy(train_cfg.eval)
        self.accuracy = cfg.recipe.accuracy  # false: the metrics are the loss alone
        self.stop = StopAgreement(rt)
        self.logger: Optional[MetricsLogger] = None  # fit's
        self.history: deque = deque(maxlen=HISTORY_ROWS)  # the last logged train/eval rows
        self.comparison: Optional[Dict[str, Any]] = None
        self.clock: Dict[str, float] = {"eval_s": 0.0}  # where the loop's wall time went
        # per phase: the loader's waited_s when its wall window opened (perf/wall_input_wait_s: the wait inside it)
        self._waited_at_window: Dict[str, float] = {}
        self._last_train: Dict[str, float] = {}
        self._script_steps = 0  # steps next_step has run
        # The stall watchdog (trainer/run/watchdog.py), while fit runs under torchrun; the allowance of a step's
        # first run in a phase and shape (compile, warm-up, capture), an evaluation and a checkpoint's save.
        self.watchdog: Optional[StallWatchdog] = None
        self.allowance_s = max(15 * (cfg.train.stall_timeout_s or 0.0), 900.0)
        self._steps_seen: set = set()
        self._last_eval: Dict[str, float] = {}
        self.last_step_done = 0.0  # perf_counter when the last step's work was done (fit)

    def resume(self, checkpoint_cfg) -> Tuple[int, Optional[str]]:
        """Restores the newest good checkpoint (or ``checkpoint.init_from``'s weights): (steps done, the
        W&B run id to continue), (0, None) for a fresh run."""
        return self.state.resume(checkpoint_cfg)

    # ---- one step: fit's, and the scripts' ------------------------------------------------
    def step_shape(self, step: int) -> StepShape:
        """The shape of the step after ``step`` steps done: the epoch's full, tail or bucket shape."""
        shape = self.train_loader.shapes.at(step % self.steps_per_epoch)
        return shape if self.seq_lens is None else replace(shape, seq_len=self.seq_lens.at(step))

    def run_step(self, step: int) -> str:
        """Stages, runs and times the step after ``step`` steps done, in the shape fit gives it (warm-up,
        capture or replay, as the executor decides); returns its phase (warmup, eager, capture, graph). The
        one step driver: fit runs it, and scripts time it (``next_step``).

        Each step shape (full, the epoch's tail, a sequence-length bucket) is its own graph,
        and is timed under its own name ("graph@tail48", "graph@full@T256"), so the headline
        numbers are those of full steps over whole windows."""
        first = "startup_s" not in self.clock
        if first:  # process start to the first step (imports, data, build)
            self.clock["startup_s"] = time.time() - process_started_at()
            began = time.perf_counter()
        shape = self.step_shape(step)
        phase = self.executor.phase(StepRole.train, shape)
        watchdog = self.watchdog
        steady = phase in ("eager", "graph") and (phase, shape) in self._steps_seen
        if watchdog is not None and not steady:  # its first time: compile, warm-up or capture take longer
            watchdog.expect(f"the first {phase} step of shape {shape}", self.allowance_s, step)
        self._steps_seen.add((phase, shape))
        self._waited_at_window.setdefault(phase, self.train_loader.waited_s)
        self.perf.begin(phase)  # opens the phase's wall window at its first step (Perf.walls)
        self.executor.run(StepRole.train, self.train_loader.stage, partial(self.train_step, shape), shape)
        if watchdog is not None:
            watchdog.step(step + 1, steady)
        if first:  # the first step's own cost (first-use initialization: kernels, optimizer state), to its end
            _synchronize(self.device)
            self.clock["first_step_s"] = time.perf_counter() - began
        plain = not shape.tail and shape.seq_len is None
        self.perf.step(phase if plain else f"{phase}@{shape}", shape)
        return phase

    def next_step(self) -> str:
        """For scripts: the step after the last one this ran (from step 0), as fit runs it, each epoch
        started where fit starts it; returns its phase."""
        step = self._script_steps
        if step % self.steps_per_epoch == 0:
            self.train_loader.start_epoch(step // self.steps_per_epoch)
        self._script_steps += 1
        return self.run_step(step)

    def phase(self) -> str:
        """What ``next_step`` will be: warmup, eager, capture or graph."""
        return self.executor.phase(StepRole.train, self.step_shape(self._script_steps))

    def warm_up(self) -> None:
        """For scripts: takes steps until the warm-up and the capture (graph modes) are done."""
        while self.phase() in ("warmup", "capture"):
            self.next_step()

    def export(self, final: Path, step: int) -> Path:
        """``checkpoint.export``: the recipe writes the trained model (``Recipe.export``, every rank: sharded, a
        collective) into a temporary directory beside ``final``, renamed to ``final`` once whole, with the record
        of this run and its ``step`` inside (trainer/checkpoint/export.py: a re-run knows its own export)."""
        from trainer.checkpoint.export import temp_export_dir, write_export_record

        rt = self.rt
        temp = temp_export_dir(final)
        began = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if rt.is_main:
            shutil.rmtree(temp, ignore_errors=True)  # an earlier attempt's, stopped mid-write
            temp.mkdir(parents=True)
        rt.barrier()
        self.recipe.export(self.raw_model, temp)
        rt.barrier()
        if rt.is_main:
            write_export_record(temp, rt.run_dir, step)
            os.replace(temp, final)
        rt.barrier()
        print_once(f"exported the trained model to {final} in {time.perf_counter() - began:.1f} s; "
                   f"{self._export_memory()}")
        return final

    def _export_memory(self) -> str:
        """What the export held at most on any rank: the process's peak host memory (over the whole run: the
        export's own is at most that) and the GPU's peak allocation during the export."""
        gpu = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else 0.0
        peaks = torch.tensor([peak_host_mib(), gpu], dtype=torch.float64, device=self.device)  # MiB
        if self.rt.distributed:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        host, gpu = (v / 1024 for v in peaks.tolist())
        during = f", peak GPU memory allocated during the export {gpu:.2f} GiB" if self.device.type == "cuda" else ""
        return f"peak host memory of a rank {host:.2f} GiB (its whole run){during}"

    def close(self) -> None:
        """Releases graphs (before the process group goes) and the loaders' workers."""
        self.executor.close()
        self.train_loader.close()
        self.eval_loader.close()

    # ---- the loop --------------------------------------------------------------------
    def fit(self, logger: MetricsLogger, start_step: int = 0) -> Dict[str, Any]:
        """Trains from ``start_step`` (steps done: 0, or where a checkpoint left off) to the end the
        config asks for (or evaluates once, train.eval_only), logging to ``logger``; returns the summary."""
        self.logger = logger
        timeout = self.cfg.train.stall_timeout_s
        if not (timeout and (self.rt.distributed or under_torchrun())):  # python train.py: nothing would restart it
            return self._fit(start_step)
        with StallWatchdog(timeout, self.rt.rank, self.device) as self.watchdog:
            try:
                return self._fit(start_step)
            finally:
                self.watchdog = None

    def _fit(self, start_step: int) -> Dict[str, Any]:
        train_cfg = self.cfg.train
        step = start_step
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        began = time.perf_counter()
        waited_before = self.train_loader.waited_s
        self.stop.start(step)
        if train_cfg.eval_only:  # the restored (or init_from) weights, evaluated once
            self._evaluate_and_log(step, epoch=step // self.steps_per_epoch)
        else:
            step = self._train_epochs(step)
        _synchronize(self.device)
        self.last_step_done = time.perf_counter()  # time/after_last_step_s counts from here (trainer/session.py write_results)
        wall = self.last_step_done - began
        # the training loop's waits for its host loader's workers (part of train_loop_s): the input's share of the run
        self.clock["input_wait_s"] = self.train_loader.waited_s - waited_before
        self.clock["total_s"] = time.time() - process_started_at()  # to the end of training, as results are written
        summary = self._summary(step, wall)
        log.info("summary: %s", summary)
        self.logger.summary(summary)
        return summary

    def _train_epochs(self, step: int) -> int:
        epochs = self.cfg.train.epochs
        first_epoch, position = divmod(step, self.steps_per_epoch)
        for epoch in range(first_epoch, epochs):
            if step >= self.total_steps:
                break
            begin = position if epoch == first_epoch else 0  # resumed mid-epoch: continue where the checkpoint was
            bar = self._start_epoch(epoch, begin)
            for i in range(begin, self.steps_per_epoch):
                if self.run_step(step) == "capture" and "until_first_graph_step_s" not in self.clock:
                    # From launch (capture synchronizes: the host clock is exact here).
                    self.clock["until_first_graph_step_s"] = time.time() - process_started_at()
                step += 1
                at = StepPoint(step, epoch, epoch_end=i == self.steps_per_epoch - 1, last=step >= self.total_steps)
                preempted = self.stop.should_stop(step)  # SIGTERM: every rank stops here, after a checkpoint
                save = self.checkpoints.due(at) or (preempted and self.checkpoints.enabled)
                if self.logs.due(at) or save:
                    # Read (and check for NaN) before saving: a checkpoint is always a good one.
                    clock_due = self._read_train_metrics(at, bar)
                    if save or clock_due:
                        if self.watchdog is not None:
                            self.watchdog.expect("a checkpoint save", self.allowance_s, step)
                        self.checkpoints.saved()
                        self.state.save(step, step // self.steps_per_epoch, self.logger.run_id,
                                       before=self.logger.write_pending)  # rows a full disk held back
                        self.stop.soon(step)  # a save's seconds are not in the stop check's spacing
                    self.perf.timer.restart()
                if preempted:
                    raise Preempted(step, self.state.last_saved, self.rt.run_dir)
                for hook in hooks.after_step:
                    hook(step, self.rt.rank)
                if self.evaluations.due(at):
                    close_bar(bar)
                    bar = None
                    if self.watchdog is not None:  # its batches mark progress (evaluate): no allowance for it whole
                        self.watchdog.expect(EVALUATION, None, step)
                    self._evaluate_and_log(step, epoch + 1)
                    self.stop.soon(step)  # nor an evaluation's
                if at.last:
                    break
            close_bar(bar)
        return step

    def _start_epoch(self, epoch: int, position: int):
        loader = self.train_loader
        loader.start_epoch(epoch)
        loader.skip(position)
        self.perf.timer.restart()
        return progress_bar(self.rt.is_main and self.cfg.train.progress, self.steps_per_epoch,
                         f"epoch {epoch + 1}/{self.cfg.train.epochs}")

    # ---- reading the device at log intervals -----------------------------------------
    def _global(self, local: torch.Tensor) -> List[float]:
        vec = local.clone()
        if self.rt.distributed:
            dist.all_reduce(vec)
        return vec.tolist()

    def _averages(self, split: str, loss_sum: float, correct: float, count: float) -> Dict[str, float]:
        """The loss (and accuracy) over the window's loss terms. A window of conversations can hold none (every
        label a prompt's): it has no average, so it logs none rather than a division by zero."""
        if count == 0:
            return {}
        return {f"{split}/loss": loss_sum / count, **({f"{split}/accuracy": correct / count} if self.accuracy else {})}

    def _read_train_metrics(self, at: StepPoint, bar) -> bool:
        """Reads, checks and logs the window's training metrics; returns whether rank 0's clock
        says a checkpoint is due (its vote travels in the same all-reduce)."""
        step_fn = self.train_step
        vote = torch.tensor([self.checkpoints.clock_vote()], dtype=torch.float64, device=self.device)
        loss_sum, correct, count, clock_due = self._global(torch.cat([step_fn.totals(), vote]))
        step_fn.reset_totals()
        if not math.isfinite(loss_sum):
            raise NonFiniteLossError(
                f"the training loss became non-finite (NaN/Inf) by step {at.step}: lower recipe.optim.lr, "
                "set train.grad_clip, or check the data")
        metrics = {**self._averages("train", loss_sum, correct, count),
                   "train/lr": float(self.optimizer.param_groups[0]["lr"]), "epoch": at.step / self.steps_per_epoch}
        if step_fn.grad_norm is not None:
            metrics["train/grad_norm"] = float(step_fn.grad_norm)  # the window's last step, before clipping
        metrics.update(self.perf.window())
        self._last_train = metrics
        self.history.append({"step": at.step, **metrics})
        self.logger.log(metrics, at.step)
        show_on_bar(bar, at, metrics, self.recipe.unit, self.steps_per_epoch)
        if self.cfg.graph.compare and self.comparison is None \
                and self.perf.timer.count("graph") >= self.cfg.graph.compare_steps:
            self.comparison = self.perf.comparison(self.logger)
        return clock_due > 0

    def evaluate(self) -> Dict[str, float]:
        executor, loader, watchdog = self.executor, self.eval_loader, self.watchdog
        if self.rt.distributed:
            take_rank0_buffers(executor.eval_model)
        executor.eval_model.eval()
        loader.start_epoch(0)
        self.eval_step.metrics.zero_()
        for _ in range(loader.steps):
            phase = executor.phase(StepRole.eval)
            first = phase == "capture" or ("eval", phase) not in self._steps_seen  # a compile, a capture: longer
            self._steps_seen.add(("eval", phase))
            if watchdog is not None and first:
                watchdog.expect(f"an evaluation's first {phase} batch", self.allowance_s)
            executor.run(StepRole.eval, loader.stage, self.eval_step)
            if watchdog is not None and not first:  # watched batch by batch, as training steps are
                watchdog.step(watchdog.at_step, steady=False, what=EVALUATION)
        if watchdog is not None:  # the batches are launched: the all-reduce below has the step's deadline
            watchdog.expect(EVALUATION)
        executor.eval_model.train()
        loss_sum, correct, count = self._global(self.eval_step.metrics)
        # count: loss terms, in the recipe's unit (samples, or tokens for language models)
        return {**self._averages("eval", loss_sum, correct, count), f"eval/{self.recipe.unit}": count}

    def _evaluate_and_log(self, step: int, epoch: int) -> None:
        began = time.perf_counter()
        result = self.evaluate()
        self.clock["eval_s"] += time.perf_counter() - began
        self._last_eval = result
        unit, best = self.recipe.unit, self.cfg.checkpoint.best_metric
        if self.cfg.train.eval_only:
            self.logger.log(result, step)
            print_once(f"evaluated the weights of step {step}: loss {result['eval/loss']:.4f}{_accuracy(result)}")
            return
        self.history.append({"step": step, **result, "epoch": epoch})
        self.logger.log({**result, "epoch": epoch}, step)
        if best and self.state.maybe_save_best(step, result, best):
            print_once(f"best {best} so far: checkpoints/best.pt (step {step})")
        print_once(f"epoch {epoch}: train loss {self._last_train.get('train/loss', math.nan):.4f} | "
                   f"test loss {result['eval/loss']:.4f}{_accuracy(result)} ({int(result[f'eval/{unit}'])} {unit})")
        self.perf.timer.restart()

    # ---- the results -----------------------------------------------------------------
    def _wall_input_wait(self, phase: str) -> Dict[str, float]:
        """perf/wall_input_wait_s: the loop's wait for its host loader's workers inside ``phase``'s wall window (the
        steady state's share of input, where time/input_wait_s also counts the first batches of warm-up)."""
        opened = self._waited_at_window.get(phase)
        return {} if opened is None else {"perf/wall_input_wait_s": self.train_loader.waited_s - opened}

    def _summary(self, steps: int, wall: float) -> Dict[str, Any]:
        report = self.executor.report
        headline_phase = self.phase()  # full steps make the headline
        if headline_phase in ("warmup", "capture"):  # too short a run to leave warm-up
            headline_phase = "warmup"
        out: Dict[str, Any] = {
            "mode": report.mode, "recipe": self.recipe.name, "data_source": self.recipe.data.source,
            **self.recipe.data.stats,
            "capture_error_mode": report.capture_error_mode,
            "precision": self.plan.precision, "world_size": self.rt.world_size, "global_batch": self.global_batch,
            "steps": steps,
            "train_loop_s": wall, **{f"time/{k}": v for k, v in self.clock.items()},
            "timed_phase": headline_phase,
            **self.perf.run_summary(headline_phase),
            **self._wall_input_wait(headline_phase),
            **{f"final/{k.split('/')[-1]}": v for k, v in self._last_train.items() if k.startswith("train/")},
            **{f"final/eval_{k.split('/')[-1]}": v for k, v in self._last_eval.items()},
            **{f"graph/{k}": v for k, v in report.as_results().items()},
        }
        # DDP keeps replicas identical; record every rank's digest of its weights to prove it. FSDP2: one digest
        # of the shards of all ranks (graphing/digest.py: the same weights give the same digest under DDP), which
        # every rank returns. Computed on the device, once, gathering no parameter.
        digest = weights_digest(self.executor.eval_model)
        digests = [digest]
        if self.rt.distributed:
            digests = [None] * self.rt.world_size
            dist.all_gather_object(digests, digest)
        out["param_digests"] = digests
        if self.cfg.graph.compare and self.comparison is None:
            self.comparison = self.perf.comparison(self.logger)
        if self.comparison:
            out.update(self.comparison)
        return out


def take_rank0_buffers(model: torch.nn.Module) -> None:
    """Every rank evaluates the model checkpoints hold, rank 0's, running statistics included.

    In training, BatchNorm reads batch statistics; its running ones are only read in evaluation.
    Without DDP's per-forward broadcast (train.ddp.broadcast_buffers=false) each rank keeps its
    own, and with it a rank's are rank 0's of one forward ago updated by its own batch. Copied
    in place: a captured evaluation graph reads the same memory.
    """
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _accuracy(result: Dict[str, float]) -> str:
    """The " accuracy 97.12%" of an evaluation's line, or nothing under recipe.accuracy=false."""
    return f" accuracy {100 * result['eval/accuracy']:.2f}%" if "eval/accuracy" in result else ""
