"""The training loop over a built run (trainer/assembly.py): train epochs, evaluate, log, summarize.

Per step the host only stages inputs, runs the step (eagerly or by graph replay, as
the executor decides) and records a timing event. It reads device values only when
the log policy says so; when to checkpoint and evaluate is asked of the policies in
trainer/policies.py, when to stop early of the ranks' agreement (trainer/stop.py).
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import replace
from functools import partial
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from graphing import StepRole, weights_digest
from trainer.assembly import Run
from trainer import hooks
from trainer.errors import NonFiniteLossError, Preempted
from trainer.metrics_logger import MetricsLogger
from trainer.policies import CheckpointPolicy, EvalPolicy, LogPolicy, StepPoint
from trainer.process_clock import process_started_at
from trainer.runtime import print_once
from trainer.stop import StopAgreement

log = logging.getLogger("train")

HISTORY_ROWS = 1000  # logged rows kept in memory (for tests and scripts); metrics.jsonl has them all


class TrainingLoop:
    def __init__(self, run: Run, logger: MetricsLogger, start_step: int = 0):
        self.run, self.logger, self.start_step = run, logger, start_step
        self.rt, self.device = run.rt, run.plan.device
        cfg = run.plan.cfg
        self.cfg = cfg
        self.logs = LogPolicy(cfg.train.log_every)
        self.checkpoints = CheckpointPolicy(cfg.checkpoint.every_steps, cfg.checkpoint.every_epochs,
                                            cfg.checkpoint.every_minutes, run.rt.is_main, cfg.checkpoint.save)
        self.evaluations = EvalPolicy(cfg.train.eval)
        self.accuracy = cfg.recipe.accuracy  # false: the metrics are the loss alone
        self.stop = StopAgreement(run.rt)
        self.history: deque = deque(maxlen=HISTORY_ROWS)  # the last logged train/eval rows
        self.comparison: Optional[Dict[str, Any]] = None
        self.clock: Dict[str, float] = {"eval_s": 0.0}  # where the loop's wall time went
        self._last_train: Dict[str, float] = {}
        self._last_eval: Dict[str, float] = {}
        self.last_step_done = 0.0  # perf_counter when the last step's work was done (fit)

    # ---- the loop --------------------------------------------------------------------
    def fit(self) -> Dict[str, Any]:
        run, loop = self.run, self.cfg.train
        step = self.start_step
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        began = time.perf_counter()
        self.stop.start(step)
        if loop.eval_only:  # the restored (or init_from) weights, evaluated once
            self._evaluate_and_log(step, epoch=step // run.steps_per_epoch)
        else:
            step = self._train_epochs(step)
        _synchronize(self.device)
        self.last_step_done = time.perf_counter()  # time/after_last_step_s counts from here (trainer/training.py)
        wall = self.last_step_done - began
        self.clock["total_s"] = time.time() - process_started_at()  # to the end of training, as results are written
        summary = self._summary(step, wall)
        log.info("summary: %s", summary)
        self.logger.summary(summary)
        return summary

    def _train_epochs(self, step: int) -> int:
        run, epochs = self.run, self.cfg.train.epochs
        first_epoch, position = divmod(step, run.steps_per_epoch)
        for epoch in range(first_epoch, epochs):
            if step >= run.total_steps:
                break
            begin = position if epoch == first_epoch else 0  # resumed mid-epoch: continue where the checkpoint was
            bar = self._start_epoch(epoch, begin)
            for i in range(begin, run.steps_per_epoch):
                if self._run_step(step, i) == "capture" and "until_first_graph_step_s" not in self.clock:
                    # From launch (capture synchronizes: the host clock is exact here).
                    self.clock["until_first_graph_step_s"] = time.time() - process_started_at()
                step += 1
                at = StepPoint(step, epoch, epoch_end=i == run.steps_per_epoch - 1, last=step >= run.total_steps)
                preempted = self.stop.should_stop(step)  # SIGTERM: every rank stops here, after a checkpoint
                save = self.checkpoints.due(at) or (preempted and self.checkpoints.enabled)
                if self.logs.due(at) or save:
                    # Read (and check for NaN) before saving: a checkpoint is always a good one.
                    clock_due = self._read_train_metrics(at, bar)
                    if save or clock_due:
                        self.checkpoints.saved()
                        run.state.save(step, step // run.steps_per_epoch, self.logger.run_id,
                                       before=self.logger.write_pending)  # rows a full disk held back
                    run.perf.timer.restart()
                if preempted:
                    raise Preempted(step, run.state.last_saved, self.rt.run_dir)
                for hook in hooks.after_step:
                    hook(step, self.rt.rank)
                if self.evaluations.due(at):
                    _close_bar(bar)
                    bar = None
                    self._evaluate_and_log(step, epoch + 1)
                if at.last:
                    break
            _close_bar(bar)
        return step

    def _start_epoch(self, epoch: int, position: int):
        loader = self.run.train_loader
        loader.start_epoch(epoch)
        loader.skip(position)
        self.run.perf.timer.restart()
        return _progress(self.rt.is_main and self.cfg.train.progress, self.run.steps_per_epoch,
                         f"epoch {epoch + 1}/{self.cfg.train.epochs}")

    def _run_step(self, step: int, i: int) -> str:
        """Stages, runs and times the epoch's step ``i`` (``step`` steps done); returns its phase
        (warmup, eager, capture, graph).

        Each step layout (full, the epoch's tail, a sequence-length bucket) is its own graph,
        and is timed under its own name ("graph@tail48", "graph@full@T256"), so the headline
        numbers are those of full steps over whole windows."""
        run = self.run
        first = "startup_s" not in self.clock
        if first:  # process start to the first step (imports, data, build)
            self.clock["startup_s"] = time.time() - process_started_at()
            began = time.perf_counter()
        layout = run.train_loader.plan.layout(i)
        if run.seq_lens is not None:
            layout = replace(layout, seq_len=run.seq_lens.at(step))
        phase = run.executor.phase(StepRole.train, layout)
        run.executor.run(StepRole.train, run.train_loader.stage, partial(run.train_step, layout), layout)
        if first:  # the first step's own cost (first-use initialization: kernels, optimizer state), to its end
            _synchronize(self.device)
            self.clock["first_step_s"] = time.perf_counter() - began
        plain = not layout.tail and layout.seq_len is None
        run.perf.step(phase if plain else f"{phase}@{layout}", layout)
        return phase

    # ---- reading the device at log intervals -----------------------------------------
    def _global(self, local: torch.Tensor) -> List[float]:
        vec = local.clone()
        if self.rt.distributed:
            dist.all_reduce(vec)
        return vec.tolist()

    def _read_train_metrics(self, at: StepPoint, bar) -> bool:
        """Reads, checks and logs the window's training metrics; returns whether rank 0's clock
        says a checkpoint is due (its vote travels in the same all-reduce)."""
        run = self.run
        step_fn = run.train_step
        vote = torch.tensor([self.checkpoints.clock_vote()], dtype=torch.float64, device=self.device)
        loss_sum, correct, count, clock_due = self._global(torch.cat([step_fn.totals(), vote]))
        step_fn.reset_totals()
        if not math.isfinite(loss_sum):
            raise NonFiniteLossError(
                f"the training loss became non-finite (NaN/Inf) by step {at.step}: lower recipe.optim.lr, "
                "set train.grad_clip, or check the data")
        metrics = {"train/loss": loss_sum / count, **({"train/accuracy": correct / count} if self.accuracy else {}),
                   "train/lr": float(run.optimizer.param_groups[0]["lr"]), "epoch": at.step / run.steps_per_epoch}
        if step_fn.grad_norm is not None:
            metrics["train/grad_norm"] = float(step_fn.grad_norm)  # the window's last step, before clipping
        metrics.update(run.perf.window())
        self._last_train = metrics
        self.history.append({"step": at.step, **metrics})
        self.logger.log(metrics, at.step)
        _show(bar, at, metrics, run.recipe.unit, run.steps_per_epoch)
        if self.cfg.graph.compare and self.comparison is None \
                and run.perf.timer.count("graph") >= self.cfg.graph.compare_steps:
            self.comparison = run.perf.comparison(self.logger)
        return clock_due > 0

    def evaluate(self) -> Dict[str, float]:
        run = self.run
        executor, loader = run.executor, run.eval_loader
        if self.rt.distributed:
            take_rank0_buffers(executor.eval_model)
        executor.eval_model.eval()
        loader.start_epoch(0)
        run.eval_step.metrics.zero_()
        for _ in range(loader.steps):
            executor.run(StepRole.eval, loader.stage, run.eval_step)
        executor.eval_model.train()
        loss_sum, correct, count = self._global(run.eval_step.metrics)
        # count: loss terms, in the recipe's unit (samples, or tokens for language models)
        return {"eval/loss": loss_sum / count, **({"eval/accuracy": correct / count} if self.accuracy else {}),
                f"eval/{run.recipe.unit}": count}

    def _evaluate_and_log(self, step: int, epoch: int) -> None:
        began = time.perf_counter()
        result = self.evaluate()
        self.clock["eval_s"] += time.perf_counter() - began
        self._last_eval = result
        unit, best = self.run.recipe.unit, self.cfg.checkpoint.best_metric
        if self.cfg.train.eval_only:
            self.logger.log(result, step)
            print_once(f"evaluated the weights of step {step}: loss {result['eval/loss']:.4f}{_accuracy(result)}")
            return
        self.history.append({"step": step, **result, "epoch": epoch})
        self.logger.log({**result, "epoch": epoch}, step)
        if best and self.run.state.maybe_save_best(step, result, best):
            print_once(f"best {best} so far: checkpoints/best.pt (step {step})")
        print_once(f"epoch {epoch}: train loss {self._last_train.get('train/loss', math.nan):.4f} | "
                   f"test loss {result['eval/loss']:.4f}{_accuracy(result)} ({int(result[f'eval/{unit}'])} {unit})")
        self.run.perf.timer.restart()

    # ---- the results -----------------------------------------------------------------
    def _summary(self, steps: int, wall: float) -> Dict[str, Any]:
        run = self.run
        report = run.executor.report
        headline_phase = run.executor.phase(StepRole.train, run.train_loader.plan.full)  # full steps make the headline
        if headline_phase in ("warmup", "capture"):  # too short a run to leave warm-up
            headline_phase = "warmup"
        out: Dict[str, Any] = {
            "mode": report.mode, "recipe": run.recipe.name, "data_source": run.recipe.data.source,
            "capture_error_mode": report.capture_error_mode,
            "precision": run.plan.precision, "world_size": self.rt.world_size, "global_batch": run.global_batch,
            "steps": steps,
            "train_loop_s": wall, **{f"time/{k}": v for k, v in self.clock.items()},
            "timed_phase": headline_phase,
            **run.perf.run_summary(headline_phase),
            **{f"final/{k.split('/')[-1]}": v for k, v in self._last_train.items() if k.startswith("train/")},
            **{f"final/eval_{k.split('/')[-1]}": v for k, v in self._last_eval.items()},
            **{f"graph/{k}": v for k, v in report.as_results().items()},
        }
        # DDP keeps replicas identical; record every rank's digest of its weights to prove it. FSDP2: one digest
        # of the shards of all ranks (graphing/digest.py: the same weights give the same digest under DDP), which
        # every rank returns. Computed on the device, once, gathering no parameter.
        digest = weights_digest(run.executor.eval_model)
        digests = [digest]
        if self.rt.distributed:
            digests = [None] * self.rt.world_size
            dist.all_gather_object(digests, digest)
        out["param_digests"] = digests
        if self.cfg.graph.compare and self.comparison is None:
            self.comparison = run.perf.comparison(self.logger)
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


def _progress(show: bool, total: int, desc: str):
    if not show:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False, mininterval=0.5, disable=None)  # None: off without a TTY


def _show(bar, at: StepPoint, metrics: Dict[str, float], unit: str, steps_per_epoch: int) -> None:
    if bar is None:
        return
    accuracy = {"acc": f"{metrics['train/accuracy']:.3f}"} if "train/accuracy" in metrics else {}
    bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", **accuracy,
                    **{f"{unit}/s": f"{metrics.get(f'perf/{unit}_per_s', 0):.0f}"})
    bar.n = (at.step - 1) % steps_per_epoch + 1
    bar.refresh()


def _accuracy(result: Dict[str, float]) -> str:
    """The " accuracy 97.12%" of an evaluation's line, or nothing under recipe.accuracy=false."""
    return f" accuracy {100 * result['eval/accuracy']:.2f}%" if "eval/accuracy" in result else ""


def _close_bar(bar) -> None:
    if bar is not None:
        bar.close()
