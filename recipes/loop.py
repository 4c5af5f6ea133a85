"""The training loop: build, train epochs, evaluate, log, summarize.

Per step the host only stages inputs, runs the step (eagerly or by graph replay) and
records a timing event. It reads device values only every ``train.log_every`` steps.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from graphing import StepTimer, build_executor, resolve_mode
from recipes import RECIPES
from recipes.checkpoint import (check_compatible, latest_checkpoint, load_checkpoint, load_optimizer_state,
                                rng_state, save_checkpoint, set_rng_state)
from recipes.data import make_loader
from recipes.metrics_logger import MetricsLogger
from recipes.optim import LRSchedule, build_optimizer
from recipes.runtime import ConfigError, Runtime, print_once
from recipes.step import EvalStep, TrainStep, autocast_factory


class NonFiniteLossError(RuntimeError):
    pass


def check_loop_config(cfg) -> None:
    t, d = cfg.train, cfg.recipe.data
    for key, value in (("train.epochs", t.epochs), ("train.log_every", t.log_every),
                       ("train.grad_accum", t.grad_accum), ("recipe.data.batch_size", d.batch_size),
                       ("recipe.data.eval_batch_size", d.eval_batch_size)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1: set {key}=...")
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"train.max_steps={t.max_steps} must be at least 1 (or null for whole epochs)")
    if t.grad_clip < 0:
        raise ConfigError(f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    if cfg.recipe.name not in RECIPES:
        raise ConfigError(f"recipe.name={cfg.recipe.name!r} is not a known recipe: choose one of "
                          f"{', '.join(sorted(RECIPES))} (recipe=<name>)")


class Trainer:
    def __init__(self, cfg, rt: Runtime):
        check_loop_config(cfg)
        self.cfg, self.rt, self.device = cfg, rt, rt.device
        self.mode = resolve_mode(cfg.graph, rt.device, rt.world_size)
        recipe = RECIPES[cfg.recipe.name](cfg, rt)
        self.recipe = recipe
        data_cfg, loop = cfg.recipe.data, cfg.train
        model = recipe.model.to(self.device)
        self.raw_model = model  # what checkpoints hold, whatever wraps it (DDP, compile, graphs)
        self.train_loader = make_loader(recipe.data.train, data_cfg.batch_size, rt, kind=data_cfg.loader.value,
                                        train=True, seed=cfg.seed, batches_per_step=loop.grad_accum,
                                        num_workers=data_cfg.num_workers)
        self.eval_loader = make_loader(recipe.data.test, data_cfg.eval_batch_size, rt, kind=data_cfg.loader.value,
                                       train=False, seed=cfg.seed, num_workers=data_cfg.num_workers)
        self.steps_per_epoch = self.train_loader.steps
        total = loop.epochs * self.steps_per_epoch
        self.total_steps = min(total, loop.max_steps) if loop.max_steps else total
        self.optimizer = build_optimizer(cfg.recipe.optim, model.parameters(), self.device)
        self.schedule = LRSchedule(cfg.recipe.schedule, cfg.recipe.optim.lr, self.total_steps)
        self.autocast = autocast_factory(loop.precision.value, self.device)
        self.executor = build_executor(cfg.graph, rt, self.mode)
        self.model = self.executor.wrap_model(model, self._sample_args(), self.autocast)
        self.train_step = TrainStep(recipe, self.model, self.optimizer, self.schedule, self.train_loader,
                                    grad_accum=loop.grad_accum, grad_clip=loop.grad_clip,
                                    autocast=self.autocast, device=self.device)
        self.eval_step = EvalStep(recipe, lambda: self.executor.eval_model, self.eval_loader,
                                  autocast=self.autocast, device=self.device)
        self.global_batch = data_cfg.batch_size * loop.grad_accum * rt.world_size
        self.timer = StepTimer(self.device)
        self.logger: Optional[MetricsLogger] = None
        self.history: List[Dict[str, Any]] = []  # every logged train/eval row, for tests and scripts
        self._logged_durations = 0
        self.comparison: Optional[Dict[str, Any]] = None
        self.config: Dict[str, Any] = resolved_config(cfg)
        self.start_step, self.wandb_run_id = 0, None
        self.clock: Dict[str, float] = {"eval_s": 0.0}  # where the loop's wall time went
        self._restore()  # before any warm-up or capture: graphs must see the restored tensors

    # ---- checkpoints -----------------------------------------------------------------
    def _restore(self) -> None:
        resume = self.cfg.checkpoint.resume
        if resume == "never":
            return
        if resume == "auto":
            found = latest_checkpoint(self.rt.run_dir)
            if found is None:
                return
            path, state = found
        else:
            path = Path(resume)
            state = load_checkpoint(path)
        check_compatible(state, self.recipe.name, resume=resume, path=path)
        self.raw_model.load_state_dict(state["model"])  # in place: DDP and graphed callables see it
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.train_step.step.fill_(state["step"])
        set_rng_state(state["rng"])  # every rank had the same RNG stream: rank 0's is everyone's
        self.start_step, self.wandb_run_id = int(state["step"]), state.get("wandb_run_id")
        print_once(f"resumed from {path} at step {self.start_step}")

    def checkpoint(self, step: int) -> None:
        """Rank 0 writes the full training state atomically; every rank waits for it."""
        if self.rt.is_main:
            state = {
                "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": step, "epoch": step // self.steps_per_epoch, "rng": rng_state(),
                "wandb_run_id": self.logger.run_id if self.logger else None,
                "recipe": self.recipe.name, "config": self.config,
            }
            save_checkpoint(self.rt.run_dir, step, state, self.cfg.checkpoint.keep)
        self.rt.barrier()

    def _maybe_fail(self, step: int) -> None:
        """Fault injection for the restart tests: one rank dies hard, on the first attempt only."""
        ck = self.cfg.checkpoint
        if ck.fail_at_step == step and self.rt.rank == ck.fail_rank \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            print(f"[rank {self.rt.rank}] checkpoint.fail_at_step={step}: killing this rank", flush=True)
            os._exit(13)

    def _sample_args(self):
        """One preprocessed training input, for modes that trace the model ahead of time."""
        if self.mode != "partial":
            return ()
        self.train_loader.stage()
        x = self.recipe.preprocess(self.train_loader.next_batch(), True)["x"]
        self.train_loader.start_epoch(0)
        return (x,)

    # ---- logging helpers -------------------------------------------------------------
    def _global(self, local: torch.Tensor) -> List[float]:
        vec = local.clone()
        if self.rt.distributed:
            dist.all_reduce(vec)
        return vec.tolist()

    def _read_train_metrics(self, step: int, steps_in_window: int) -> Dict[str, float]:
        self.timer.collect()
        loss_sum, correct = self._global(self.train_step.metrics)
        self.train_step.metrics.zero_()
        micro_batches = steps_in_window * self.cfg.train.grad_accum * self.rt.world_size
        count = steps_in_window * self.train_step.items_per_step * self.rt.world_size
        if not math.isfinite(loss_sum):
            raise NonFiniteLossError(
                f"the training loss became non-finite (NaN/Inf) by step {step}: lower recipe.optim.lr, "
                "set train.grad_clip, or check the data")
        new = self.timer.sequence_ms[self._logged_durations:]
        self._logged_durations = len(self.timer.sequence_ms)
        out = {"train/loss": loss_sum / micro_batches, "train/accuracy": correct / count,
               "train/lr": float(self.optimizer.param_groups[0]["lr"]), "epoch": step / self.steps_per_epoch}
        if new:
            ms = sum(new) / len(new)
            out["perf/step_ms"] = ms
            out[f"perf/{self.recipe.unit}_per_s"] = self.global_batch * self.recipe.units_per_sample * 1e3 / ms
        return out

    def evaluate(self) -> Dict[str, float]:
        self.executor.eval_model.eval()
        self.eval_loader.start_epoch(0)
        self.eval_step.metrics.zero_()
        for _ in range(self.eval_loader.steps):
            self.executor.run("eval", self.eval_loader.stage, self.eval_step)
        self.executor.eval_model.train()
        loss_sum, correct, _, count = self._global(self.eval_step.metrics)
        return {"eval/loss": loss_sum / count, "eval/accuracy": correct / count, "eval/samples": count}

    # ---- the loop --------------------------------------------------------------------
    def fit(self, logger: MetricsLogger) -> Dict[str, Any]:
        self.logger = logger
        loop = self.cfg.train
        show = self.rt.is_main and loop.progress
        step = last_read = self.start_step
        done = step >= self.total_steps
        first_epoch, position = divmod(step, self.steps_per_epoch)
        every = self.cfg.checkpoint.every_steps
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        eval_result: Dict[str, float] = {}
        last_train: Dict[str, float] = {}
        for epoch in range(first_epoch, loop.epochs):
            if done:
                break
            self.train_loader.start_epoch(epoch)
            begin = position if epoch == first_epoch else 0
            self.train_loader.skip(begin)  # resumed mid-epoch: continue where the checkpoint was
            bar = _progress(show, self.steps_per_epoch, f"epoch {epoch + 1}/{loop.epochs}")
            self.timer.restart()
            for i in range(begin, self.steps_per_epoch):
                phase = self.executor.phase("train")
                self.executor.run("train", self.train_loader.stage, self.train_step)
                self.timer.step(phase)
                if phase == "capture":  # capture synchronizes: the host clock is exact here
                    self.clock["until_first_graph_step_s"] = time.perf_counter() - start
                step += 1
                done = step >= self.total_steps
                checkpoint_now = (every > 0 and step % every == 0) or done
                if step % loop.log_every == 0 or done or i == self.steps_per_epoch - 1 or checkpoint_now:
                    # Read (and check for NaN) before saving: a checkpoint is always a good one.
                    last_train = self._read_train_metrics(step, step - last_read)
                    last_read = step
                    self._after_log(step, last_train, bar)
                    if checkpoint_now:
                        self.checkpoint(step)
                    self.timer.restart()
                self._maybe_fail(step)
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
                print_once(f"epoch {epoch + 1}: train loss {last_train.get('train/loss', math.nan):.4f} | "
                           f"test loss {eval_result['eval/loss']:.4f} "
                           f"accuracy {100 * eval_result['eval/accuracy']:.2f}% "
                           f"({int(eval_result['eval/samples'])} samples)")
                self.timer.restart()
            if done:
                break
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        summary = self._summary(step, wall, last_train, eval_result)
        logger.summary(summary)
        return summary

    def _after_log(self, step: int, metrics: Dict[str, float], bar) -> None:
        self.history.append({"step": step, **metrics})
        self.logger.log(metrics, step)
        if bar is not None:
            bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{metrics['train/accuracy']:.3f}",
                            **{f"{self.recipe.unit}/s": f"{metrics.get(f'perf/{self.recipe.unit}_per_s', 0):.0f}"})
            bar.n = (step - 1) % self.steps_per_epoch + 1
            bar.refresh()
        if self.cfg.graph.compare and self.comparison is None \
                and len(self.timer.durations_ms.get("graph", [])) >= self.cfg.graph.compare_steps:
            self.comparison = self._compare()

    def _perf(self, phase: str) -> Dict[str, float]:
        s = self.timer.summary(phase)
        if not s:
            return {}
        units = self.global_batch * self.recipe.units_per_sample
        s[f"{self.recipe.unit}_per_s"] = units * 1e3 / s["step_ms_mean"]
        s[f"{self.recipe.unit}_per_s_per_gpu"] = s[f"{self.recipe.unit}_per_s"] / self.rt.world_size
        peak = self._peak_flops()
        if peak is not None and self.recipe.flops_per_unit > 0:
            s["mfu_pct"] = 100 * s[f"{self.recipe.unit}_per_s_per_gpu"] * self.recipe.flops_per_unit / (peak[1] * 1e12)
        return s

    def _peak_flops(self):
        """(name, dense TFLOP/s) of this GPU at the run's precision, or None off CUDA or for an unlisted GPU."""
        if self.device.type != "cuda":
            return None
        return peak_tflops(torch.cuda.get_device_name(self.device), self.cfg.train.precision.value)

    def _compare(self) -> Dict[str, Any]:
        eager, graph = self._perf("eager"), self._perf("graph")
        if not eager or not graph:
            return {}
        speedup = eager["step_ms_mean"] / graph["step_ms_mean"]
        result = {**{f"eager/{k}": v for k, v in eager.items()}, **{f"graph/{k}": v for k, v in graph.items()},
                  "speedup": speedup}
        unit = f"{self.recipe.unit}_per_s"
        rows = [[name, side[unit], side["step_ms_median"], side["step_ms_p90"], side["steps_timed"]]
                for name, side in (("eager", eager), ("graph", graph))]
        print_once(_markdown(["mode", unit, "step ms median", "step ms p90", "steps"], rows)
                   + f"\nspeedup (graph vs eager, same process, same data): {speedup:.2f}x")
        if self.logger is not None:
            self.logger.summary(result)
            self.logger.table("comparison", ["mode", unit, "step_ms_median", "step_ms_p90", "steps"], rows,
                              bar=("mode", unit))
        return result

    def _summary(self, steps: int, wall: float, train: Dict[str, float], evaluation: Dict[str, float]):
        headline_phase = self.executor.phase("train")
        if headline_phase in ("warmup", "capture"):  # too short a run to leave warm-up
            headline_phase = "warmup"
        perf = self._perf(headline_phase)
        out: Dict[str, Any] = {
            "mode": self.executor.info["mode"], "recipe": self.recipe.name, "data_source": self.recipe.data.source,
            "world_size": self.rt.world_size, "global_batch": self.global_batch, "steps": steps,
            "train_loop_s": wall, **{f"time/{k}": v for k, v in self.clock.items()},
            "timed_phase": headline_phase,
            **{f"perf/{k}": v for k, v in perf.items()},
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
        peak = self._peak_flops()
        if peak is not None and self.recipe.flops_per_unit > 0:
            out["perf/mfu_peak"], out["perf/mfu_peak_tflops"] = peak
            out["perf/flops_per_unit"] = self.recipe.flops_per_unit
        if self.device.type == "cuda":
            out["perf/peak_allocated_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            out["perf/peak_reserved_mib"] = torch.cuda.max_memory_reserved(self.device) / 2**20
        if self.cfg.graph.compare and self.comparison is None:
            self.comparison = self._compare()
        if self.comparison:
            out.update(self.comparison)
        return out

    def close(self) -> None:
        self.executor.close()


# Dense tensor-core peaks, TFLOP/s (NVIDIA datasheets; "dense" = half the with-sparsity figure).
# Matched in order against torch.cuda.get_device_name(); the first name contained wins.
# fp32 runs are measured against the TF32 peak, the most an fp32 model can get from the
# tensor cores (cuDNN convolutions use TF32 by default; matmuls only where it is allowed).
PEAK_TFLOPS = (  # (name part, label, bf16 dense, tf32 dense)
    ("H100 PCIe", "H100 PCIe", 756.0, 378.0),
    ("H100 NVL", "H100 NVL", 835.0, 417.5),
    ("H200 NVL", "H200 NVL", 835.0, 417.5),
    ("H100", "H100 SXM", 989.0, 494.5),
    ("H200", "H200 SXM", 989.0, 494.5),
    ("A100", "A100", 312.0, 156.0),
)


def peak_tflops(device_name: str, precision: str):
    """("<GPU> <bf16|tf32> dense", TFLOP/s) for a known GPU, else None."""
    for part, label, bf16, tf32 in PEAK_TFLOPS:
        if part.lower() in device_name.lower():
            return (f"{label} bf16 dense", bf16) if precision == "bf16" else (f"{label} tf32 dense", tf32)
    return None


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


def _markdown(columns: List[str], rows: List[List[Any]]) -> str:
    def fmt(v):
        return f"{v:,.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def resolved_config(cfg) -> Dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def write_json(path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
