"""The training loop: build the run, train epochs, evaluate, log, summarize.

Per step the host only stages inputs, runs the step (eagerly or by graph replay, as
the executor decides) and records a timing event. It reads device values only every
``train.log_every`` steps.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from graphing import build_executor
from trainer.data import choose_loader, make_loader
from trainer.errors import ConfigError, NonFiniteLossError, Preempted
from trainer.metrics_logger import MetricsLogger
from trainer.optim import build_optimizer, build_schedule
from trainer.perf import Perf
from trainer.recipe import Recipe
from trainer.runtime import Runtime, print_once, process_started_at, seed_rank_streams
from trainer.state import TrainingState
from trainer.step import (EvalStep, TrainStep, autocast_factory, model_input, resolve_memory_format,
                          resolve_precision)
from trainer.stop import StopAgreement
from trainer.validate import graph_options, recipe_builder

# Test-only fault injection: "STEP" or "STEP:RANK" (rank 1 by default) kills that rank
# hard right after that step, on a job's first attempt only (the restart tests).
KILL_AT_STEP_ENV = "GRAPHED_DDP_TEST_KILL_AT_STEP"


class Trainer:
    def __init__(self, cfg, rt: Runtime):
        self.cfg, self.rt, self.device = cfg, rt, rt.device
        loop, data_cfg = cfg.train, cfg.recipe.data
        self.options = graph_options(cfg, rt.device, rt.world_size)
        recipe = recipe_builder(cfg)(cfg, rt)
        if not isinstance(recipe, Recipe):
            raise ConfigError(f"recipe._target_={cfg.recipe._target_} returned a {type(recipe).__name__}, not a "
                              "trainer.recipe.Recipe: see trainer/recipe.py for the contract")
        self.recipe = recipe
        self.memory_format = resolve_memory_format(loop.memory_format.value, recipe.model, rt.device)
        model = recipe.model.to(self.device, memory_format=self.memory_format)
        self.raw_model = model  # what checkpoints hold, whatever wraps it (DDP, compile, graphs)
        seed_rank_streams(cfg.seed, rt.rank)  # the model is built alike on every rank; the step's draws differ
        loader_kind = choose_loader(data_cfg.loader.value, recipe.data.train, recipe.data.test, rt.device)
        self.train_loader = make_loader(recipe.data.train, data_cfg.batch_size, rt, kind=loader_kind,
                                        train=True, seed=cfg.seed, batches_per_step=loop.grad_accum,
                                        num_workers=data_cfg.num_workers)
        self.eval_loader = make_loader(recipe.data.test, data_cfg.eval_batch_size, rt, kind=loader_kind,
                                       train=False, seed=cfg.seed, num_workers=data_cfg.num_workers)
        self.steps_per_epoch = self.train_loader.steps
        total = loop.epochs * self.steps_per_epoch
        self.total_steps = min(total, loop.max_steps) if loop.max_steps else total
        # Gradients as views into DDP's all-reduce buckets: after the all-reduce nothing is
        # copied back into them (one copy kernel per parameter less in every step).
        self.executor = build_executor(self.options, self.device, ddp_kwargs={"gradient_as_bucket_view": True})
        self.optimizer = build_optimizer(cfg.recipe.optim, model.parameters(), self.device,
                                         captured=self.executor.captures_optimizer)
        self.schedule = build_schedule(cfg.recipe.schedule, float(cfg.recipe.optim.lr), self.total_steps)
        self.precision = resolve_precision(loop.precision.value, self.device)
        self.autocast = autocast_factory(self.precision, self.device)
        self.model = self.executor.wrap_model(model, self._sample_inputs, self.autocast)
        self.train_step = TrainStep(recipe, self.model, self.optimizer, self.schedule, self.train_loader,
                                    grad_accum=loop.grad_accum, grad_clip=loop.grad_clip,
                                    autocast=self.autocast, device=self.device, memory_format=self.memory_format,
                                    wrap_output_fn=self.executor.wrap_output_fn)
        self.eval_step = EvalStep(recipe, lambda: self.executor.eval_model, self.eval_loader,
                                  autocast=self.autocast, device=self.device, memory_format=self.memory_format)
        self.global_batch = data_cfg.batch_size * loop.grad_accum * rt.world_size
        self.perf = Perf(self.device, units_per_step=self.global_batch * recipe.units_per_sample, unit=recipe.unit,
                         world_size=rt.world_size, flops_per_unit=recipe.flops_per_unit,
                         precision=self.precision)
        self.config: Dict[str, Any] = resolved_config(cfg)
        # What this run actually uses, beside what was asked for.
        self.config["recipe"]["data"]["source_used"] = recipe.data.source
        self.config["recipe"]["data"]["loader_used"] = loader_kind
        self.config["graph"]["mode_used"] = self.options.mode
        self.config["train"]["precision_used"] = self.precision
        self.config["train"]["memory_format_used"] = str(self.memory_format).replace("torch.", "")
        self.config["graph"]["capture_error_mode_used"] = self.executor.info["capture_error_mode"]
        self.config["world_size"] = rt.world_size
        self.state = TrainingState(rt, model=model, optimizer=self.optimizer, step_counter=self.train_step.step,
                                   recipe_name=recipe.name, config=self.config, seed=cfg.seed,
                                   keep=cfg.checkpoint.keep)
        self.logger: Optional[MetricsLogger] = None
        self.history: List[Dict[str, Any]] = []  # every logged train/eval row, for tests and scripts
        self.comparison: Optional[Dict[str, Any]] = None
        self.clock: Dict[str, float] = {"eval_s": 0.0}  # where the loop's wall time went
        self.stop = StopAgreement(rt)
        # Before any warm-up or capture: graphs must see the restored tensors.
        restored = self.state.restore(cfg.checkpoint.resume)
        if restored is None and cfg.checkpoint.init_from is not None:  # a resume of this run wins
            self.state.init_weights(cfg.checkpoint.init_from)
        self.start_step = int(restored["step"]) if restored else 0
        self.wandb_run_id = restored.get("wandb_run_id") if restored else None

    def _sample_inputs(self):
        """One preprocessed training input, for executors that trace the model ahead of time."""
        self.train_loader.stage()
        x = model_input(self.recipe.preprocess(self.train_loader.next_batch(), True), self.memory_format)
        self.train_loader.start_epoch(0)
        return (x,)

    # ---- reading the device at log intervals -----------------------------------------
    def _global(self, local: torch.Tensor) -> List[float]:
        vec = local.clone()
        if self.rt.distributed:
            dist.all_reduce(vec)
        return vec.tolist()

    def _checkpoint_time_due(self) -> bool:
        """Rank 0's clock decides; the answer travels with the metrics' all-reduce."""
        minutes = self.cfg.checkpoint.every_minutes
        return self.rt.is_main and minutes > 0 and time.monotonic() - self._last_checkpoint_at >= 60 * minutes

    def _read_train_metrics(self, step: int, steps_in_window: int) -> Dict[str, float]:
        due = torch.tensor([1.0 if self._checkpoint_time_due() else 0.0], dtype=torch.float64, device=self.device)
        loss_sum, correct, due = self._global(torch.cat([self.train_step.totals(), due]))
        self._checkpoint_due_by_time = due > 0
        self.train_step.reset_totals()
        micro_batches = steps_in_window * self.cfg.train.grad_accum * self.rt.world_size
        count = steps_in_window * self.train_step.items_per_step * self.rt.world_size
        if not math.isfinite(loss_sum):
            raise NonFiniteLossError(
                f"the training loss became non-finite (NaN/Inf) by step {step}: lower recipe.optim.lr, "
                "set train.grad_clip, or check the data")
        out = {"train/loss": loss_sum / micro_batches, "train/accuracy": correct / count,
               "train/lr": float(self.optimizer.param_groups[0]["lr"]), "epoch": step / self.steps_per_epoch}
        if self.train_step.grad_norm is not None:
            out["train/grad_norm"] = float(self.train_step.grad_norm)  # the window's last step, before clipping
        out.update(self.perf.window())
        return out

    def evaluate(self) -> Dict[str, float]:
        self.executor.eval_model.eval()
        self.eval_loader.start_epoch(0)
        self.eval_step.metrics.zero_()
        for _ in range(self.eval_loader.steps):
            self.executor.run("eval", self.eval_loader.stage, self.eval_step)
        self.executor.eval_model.train()
        loss_sum, correct, count = self._global(self.eval_step.metrics)
        # count: loss terms, in the recipe's unit (samples, or tokens for language models)
        return {"eval/loss": loss_sum / count, "eval/accuracy": correct / count, f"eval/{self.recipe.unit}": count}

    # ---- the loop --------------------------------------------------------------------
    def fit(self, logger: MetricsLogger) -> Dict[str, Any]:
        self.logger = logger
        loop = self.cfg.train
        timer = self.perf.timer
        show = self.rt.is_main and loop.progress
        step = last_read = self.start_step
        done = step >= self.total_steps
        first_epoch, position = divmod(step, self.steps_per_epoch)
        every, every_epochs = self.cfg.checkpoint.every_steps, self.cfg.checkpoint.every_epochs
        self._last_checkpoint_at = time.monotonic()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        eval_result: Dict[str, float] = {}
        last_train: Dict[str, float] = {}
        self.stop.start(step)
        if loop.eval_only:  # the restored (or init_from) weights, evaluated once
            eval_result = self.evaluate()
            logger.log(eval_result, step)
            print_once(f"evaluated the weights of step {step}: loss {eval_result['eval/loss']:.4f} "
                       f"accuracy {100 * eval_result['eval/accuracy']:.2f}%")
            done = True
        for epoch in range(first_epoch, loop.epochs):
            if done:
                break
            self.train_loader.start_epoch(epoch)
            begin = position if epoch == first_epoch else 0
            self.train_loader.skip(begin)  # resumed mid-epoch: continue where the checkpoint was
            bar = _progress(show, self.steps_per_epoch, f"epoch {epoch + 1}/{loop.epochs}")
            timer.restart()
            for i in range(begin, self.steps_per_epoch):
                if "startup_s" not in self.clock:  # process start to the first step (imports, data, build)
                    self.clock["startup_s"] = time.time() - process_started_at()
                phase = self.executor.phase("train")
                self.executor.run("train", self.train_loader.stage, self.train_step)
                timer.step(phase)
                if phase == "capture":  # capture synchronizes: the host clock is exact here
                    self.clock["until_first_graph_step_s"] = time.perf_counter() - start
                step += 1
                done = step >= self.total_steps
                epoch_end = i == self.steps_per_epoch - 1
                stopping = self.stop.should_stop(step)  # SIGTERM: every rank stops here, after a checkpoint
                checkpoint_now = (every > 0 and step % every == 0) or done or stopping \
                    or (epoch_end and every_epochs > 0 and (epoch + 1) % every_epochs == 0)
                if step % loop.log_every == 0 or done or epoch_end or checkpoint_now:
                    # Read (and check for NaN) before saving: a checkpoint is always a good one.
                    last_train = self._read_train_metrics(step, step - last_read)
                    last_read = step
                    self._after_log(step, last_train, bar)
                    checkpoint_now = checkpoint_now or self._checkpoint_due_by_time
                    if checkpoint_now:
                        self._last_checkpoint_at = time.monotonic()
                        self.state.save(step, step // self.steps_per_epoch, logger.run_id)
                    timer.restart()
                if stopping:
                    raise Preempted(step, self.state.last_saved, self.rt.run_dir)
                _kill_for_test(step, self.rt.rank)
                if done:
                    break
            if bar is not None:
                bar.close()
            if loop.eval:
                eval_began = time.perf_counter()
                eval_result = self.evaluate()
                self.clock["eval_s"] += time.perf_counter() - eval_began
                self.history.append({"step": step, **eval_result, "epoch": epoch + 1})
                logger.log({**eval_result, "epoch": epoch + 1}, step)
                if self.cfg.checkpoint.best_metric and self.state.maybe_save_best(step, eval_result,
                                                                                  self.cfg.checkpoint.best_metric):
                    print_once(f"best {self.cfg.checkpoint.best_metric} so far: checkpoints/best.pt (step {step})")
                print_once(f"epoch {epoch + 1}: train loss {last_train.get('train/loss', math.nan):.4f} | "
                           f"test loss {eval_result['eval/loss']:.4f} "
                           f"accuracy {100 * eval_result['eval/accuracy']:.2f}% "
                           f"({int(eval_result[f'eval/{self.recipe.unit}'])} {self.recipe.unit})")
                timer.restart()
            if done:
                break
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        self.clock["total_s"] = time.time() - process_started_at()  # to the end of training, as results are written
        summary = self._summary(step, wall, last_train, eval_result)
        logger.summary(summary)
        return summary

    def _after_log(self, step: int, metrics: Dict[str, float], bar) -> None:
        self.history.append({"step": step, **metrics})
        self.logger.log(metrics, step)
        if bar is not None:
            unit = self.recipe.unit
            bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{metrics['train/accuracy']:.3f}",
                            **{f"{unit}/s": f"{metrics.get(f'perf/{unit}_per_s', 0):.0f}"})
            bar.n = (step - 1) % self.steps_per_epoch + 1
            bar.refresh()
        if self.cfg.graph.compare and self.comparison is None \
                and len(self.perf.timer.durations_ms.get("graph", [])) >= self.cfg.graph.compare_steps:
            self.comparison = self.perf.comparison(self.logger)

    def _summary(self, steps: int, wall: float, train: Dict[str, float], evaluation: Dict[str, float]):
        headline_phase = self.executor.phase("train")
        if headline_phase in ("warmup", "capture"):  # too short a run to leave warm-up
            headline_phase = "warmup"
        out: Dict[str, Any] = {
            "mode": self.executor.info["mode"], "recipe": self.recipe.name, "data_source": self.recipe.data.source,
            "capture_error_mode": self.executor.info["capture_error_mode"],
            "precision": self.precision, "world_size": self.rt.world_size, "global_batch": self.global_batch,
            "steps": steps,
            "train_loop_s": wall, **{f"time/{k}": v for k, v in self.clock.items()},
            "timed_phase": headline_phase,
            **self.perf.run_summary(headline_phase),
            **{f"final/{k.split('/')[-1]}": v for k, v in train.items() if k.startswith("train/")},
            **{f"final/eval_{k.split('/')[-1]}": v for k, v in evaluation.items()},
        }
        for key in ("train_capture_s", "eval_capture_s", "graph_pool_mib", "fallback"):
            if key in self.executor.info:
                out[f"graph/{key}"] = self.executor.info[key]
        # DDP keeps replicas identical; record every rank's parameter digest to prove it.
        digests = [param_digest(self.executor.eval_model)]
        if self.rt.distributed:
            digests = [None] * self.rt.world_size
            dist.all_gather_object(digests, param_digest(self.executor.eval_model))
        out["param_digests"] = digests
        if self.cfg.graph.compare and self.comparison is None:
            self.comparison = self.perf.comparison(self.logger)
        if self.comparison:
            out.update(self.comparison)
        return out

    def close(self) -> None:
        self.executor.close()
        self.train_loader.close()
        self.eval_loader.close()


def _kill_for_test(step: int, rank: int) -> None:
    """Fault injection for the restart tests (see KILL_AT_STEP_ENV)."""
    spec = os.environ.get(KILL_AT_STEP_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    at, _, victim = spec.partition(":")
    if step == int(at) and rank == int(victim or 1):
        print(f"[rank {rank}] {KILL_AT_STEP_ENV}={spec}: killing this rank at step {step}", flush=True)
        os._exit(13)


def param_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: equal digests mean bitwise-equal replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _progress(show: bool, total: int, desc: str):
    if not show:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False, mininterval=0.5, disable=None)  # None: off without a TTY


def resolved_config(cfg) -> Dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def write_json(path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
