"""Every job's frame, and the training job: for train.py and every script.

    def job(session):                  # train (``fit_job`` below), diagnose, benchmark
        trainer = session.build()      # the Trainer (trainer/trainer.py), closed by the session
        ...
    return Session(cfg).execute(job)   # plan, join, job; on every path: teardown in reverse, and an
                                       # error becomes one message and an exit code

``plan``: every check that needs no data, before the ranks meet (trainer/plan.py); ``join``: the
process group, an agreed run directory, logging, seeds (trainer/run/runtime.py).

Teardown, in reverse: graphs and loaders (before the process group), the metrics logger (W&B),
the process group, the log handlers. Each expected failure becomes one message, printed by rank
0, and an exit code; a crash prints its traceback once per rank and exits 1, except a collective
that lost its peer (a rank killed or crashed elsewhere): one line from rank 0, the trace in each
rank's log file. What a run must hold for its whole life (a lock on its run directory,
trainer/run/run_lock.py) is taken in ``join`` and given back at teardown.

``train(cfg)`` is one training run on one page: plan → process group → build → resume → fit →
results → teardown.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from omegaconf import OmegaConf

from trainer.run.errors import (EXIT_CAPTURE, EXIT_CONFIG, EXIT_CRASH, EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_STORAGE,
                                first_line)
from trainer.run.log_files import log_to_file, start_logging, stop_logging
from trainer.run.process import hydra_overrides, multirun_job_dir, peer_gone, tell_torchrun

if TYPE_CHECKING:  # imported when first used: `train.py --help` and config errors stay fast
    from trainer.trainer import Trainer
    from trainer.metrics.logger import MetricsLogger
    from trainer.plan import RunPlan
    from trainer.recipe import Recipe
    from trainer.run.runtime import Runtime


log = logging.getLogger("train")


class Session:
    """``purpose`` names the run directory (``<recipe>_<purpose>``; default: the graph mode)."""

    def __init__(self, cfg, purpose: Optional[str] = None):
        self.cfg, self.purpose = cfg, purpose
        self.exit_code = 0
        self.run_plan: Optional["RunPlan"] = None
        self.rt: Optional["Runtime"] = None
        self.trainer: Optional["Trainer"] = None
        self.logger: Optional["MetricsLogger"] = None
        self._handlers: List[logging.Handler] = []

    def execute(self, job: Callable[["Session"], int]) -> int:
        """Runs ``job(self)`` after the plan and the join; returns the process's exit code. A job's
        own non-zero verdict (the doctor's) is a clean end for its W&B run."""
        with self:
            self.plan()
            self.join()
            self.exit_code = job(self) or 0
        return self.exit_code

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind, error, _trace) -> bool:
        if error is None or not isinstance(error, Exception):  # done, or Ctrl-C / SystemExit: teardown only
            # a job's own verdict (the doctor's non-zero code) is a clean end for its W&B run
            self._close(logger_code=0, clean=error is None)
            return False
        code, clean, failed_together = self._report(error)
        self.exit_code = code
        self._close(logger_code=code if failed_together or not clean else 0, clean=clean)
        return True

    def _report(self, e: Exception):
        """Says ``e`` once and returns (exit code, clean: the ranks end together, failed_together:
        a clean end that is still a failure for the W&B run)."""
        from graphing import CaptureError
        from trainer.run.errors import ConfigError, NonFiniteLossError, Preempted, StorageError
        from trainer.plan import graph_setting
        from trainer.run.runtime import env_rank, print_once
        from trainer.run.stop import stop_requested

        expected = ((ConfigError, EXIT_CONFIG), (CaptureError, EXIT_CAPTURE), (NonFiniteLossError, EXIT_NONFINITE),
                    (StorageError, EXIT_STORAGE))
        code = next((c for kind, c in expected if isinstance(e, kind)), None)
        if code is not None:
            together = isinstance(e, StorageError)  # every rank raised it after one broadcast
            said = e.render(graph_setting) if isinstance(e, CaptureError) else str(e)  # in this trainer's words
            message = f"Error: {said}"
            print_once(message, file=sys.stderr)
            if env_rank() == 0:  # the same on every rank: once in the report too
                tell_torchrun(message)
            return code, together, together
        if isinstance(e, Preempted):  # every rank agreed on the step and the checkpoint is written: an orderly end
            print_once(str(e), file=sys.stderr)
            return EXIT_PREEMPTED, True, True
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        if peer_gone(e) or stop_requested():  # not this rank's fault: one line, the trace in its log file
            # (torchrun stops the survivors of a failed rank with SIGTERM, their loader workers too)
            log.info("a peer rank is gone or the job is being stopped:\n%s", text)
            said = (f"[rank {env_rank()}] stopping: another rank is gone or the job is being stopped "
                    f"({first_line(e)}); torchrun restarts the job if --max-restarts allows, and its report "
                    "names the rank that failed first")
            print_once(said, file=sys.stderr)
            tell_torchrun(said)
            return (EXIT_PREEMPTED if stop_requested() else EXIT_CRASH), False, False
        if _out_of_device_memory(e):  # one line that names what to change, from each rank that ran out
            log.info("out of device memory:\n%s", text)  # the trace in the rank's log file, not the console
            said = (f"[rank {env_rank()}] out of GPU memory ({first_line(e)[:160]}): the model's weights, gradients "
                    "and optimizer state with the step's activations need more than this GPU holds. Set "
                    "train.parallel=fsdp2 (shards them over the ranks), or lower recipe.data.batch_size (with "
                    "train.grad_accum to keep the batch), or set train.activation_checkpointing=true")
            print(said, file=sys.stderr, flush=True)
            tell_torchrun(said)
            return EXIT_CRASH, False, False
        log.error("crashed:\n%s", text)  # the rank's log file; rank 0's console too
        if self.rt is None or not self.rt.is_main:
            print(f"[rank {env_rank()}] {text}", file=sys.stderr, flush=True)
        tell_torchrun(text)
        return EXIT_CRASH, False, False

    def plan(self) -> "RunPlan":
        """Every check and choice that needs no data, once, before the ranks meet (trainer/plan.py)."""
        from trainer.plan import plan_run
        from trainer.run.runtime import pick_device

        device = pick_device(self.cfg.device.value)
        self.run_plan = plan_run(self.cfg, device, int(os.environ.get("WORLD_SIZE", "1")))
        return self.run_plan

    def join(self) -> "Runtime":
        """The process group, the run directory all ranks agree on (and its lock), logging, seeds."""
        from trainer.run.runtime import seed_everything, start

        cfg = self.cfg
        name = f"{cfg.recipe.name}_{self.purpose or self.run_plan.mode}"
        parallelism = self.run_plan.parallelism
        self.rt = start(self.run_plan.device, cfg.output_root, cfg.run_dir or multirun_job_dir(), name,
                        take_over_run_dir=cfg.take_over_run_dir, needs_group=parallelism.sharded,
                        init_meta=parallelism.init_on_meta)
        self._handlers = start_logging(self.rt.is_main)
        seed_everything(cfg.seed, cfg.deterministic)
        return self.rt

    def build(self) -> "Trainer":
        """The run's Trainer (trainer/trainer.py), built once; the session closes it."""
        from trainer.trainer import Trainer

        self.trainer = Trainer(self.run_plan, self.rt)
        return self.trainer

    def open_run_dir(self) -> Path:
        """Creates the run directory (only once the run is built: a config error found while
        building leaves no directory behind); from here on each rank logs to rank<N>.log."""
        self.rt.make_run_dir()
        log_to_file(self.rt.run_dir / f"rank{self.rt.rank}.log", self._handlers[0])
        return self.rt.run_dir

    def open_logger(self, config: Dict[str, Any], job_type: str, run_id: Optional[str] = None):
        """The metrics logger (metrics.jsonl, W&B) of this session; finished at teardown."""
        from trainer.metrics.logger import MetricsLogger

        self.logger = MetricsLogger(self.cfg.logger, self.rt.run_dir, config, rank=self.rt.rank,
                                    job_type=job_type, run_id=run_id)
        return self.logger

    def _close(self, logger_code: int, clean: bool) -> None:
        if self.trainer is not None:
            self.trainer.close()  # graphs before the process group, or exit can hang
        if self.logger is not None:
            self.logger.finish(exit_code=logger_code)
        if self.rt is not None:
            self.rt.close(clean=clean)
        stop_logging(self._handlers)


def build_recipe_alone(cfg) -> "Recipe":
    """The recipe ``cfg`` names (model and data), checked as a run would be, built for one
    process on the CPU with no process group: for scripts that need its data or its model only."""
    import torch

    from trainer.plan import plan_run
    from trainer.run.runtime import Runtime

    plan = plan_run(cfg, torch.device("cpu"), world_size=1)
    rt = Runtime(rank=0, local_rank=0, world_size=1, device=plan.device, distributed=False, run_dir=Path("."))
    return plan.build_recipe(cfg, rt)


def _out_of_device_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError)


# The training job (train.py), every script's model of a job.

def train(cfg) -> int:
    """Trains as ``cfg`` says; returns the process's exit code (0: done). The run on one page:

        plan → process group → build → resume → fit → results → teardown

    The Trainer (trainer/trainer.py) builds the run and runs its loop; the step order itself is
    trainer/step/steps.py (``TrainStep.__call__``)."""
    return Session(cfg).execute(fit_job)  # plan, join, the job; teardown in reverse; an error becomes a code


def fit_job(session: Session) -> int:
    """The training job, after the plan and the join: build, resume, fit, export, results. The same command on a
    complete run exits 0 having done nothing, or only the export it had not finished (trainer/checkpoint/export.py)."""
    from trainer.checkpoint.export import export_directory, export_is_done

    cfg = session.cfg
    trainer = session.build()  # recipe, model, executor, optimizer, loaders, steps, checkpointable state
    start_step, wandb_run_id = trainer.resume(cfg.checkpoint)  # before any warm-up or capture
    # The trained model in its library's format (Recipe.export), written once the run is complete
    export = export_directory(cfg.checkpoint.export)
    last_step = None if cfg.train.eval_only else trainer.total_steps
    if export is not None and export_is_done(export, trainer.rt.run_dir, last_step):  # else refused, or not yet
        say_complete(trainer, max(start_step, last_step), export)  # a finished run is left alone
        return 0
    if last_step is not None and start_step >= last_step:
        if export is not None:  # it finished training but not its export (killed, restarted): from its checkpoint
            trainer.export(export, start_step)
        say_complete(trainer, start_step, export)
        return 0
    session.open_run_dir()
    trainer.state.on_rank0(lambda: write_run_config(trainer))
    announce(trainer)
    logger = session.open_logger(trainer.config, job_type=trainer.plan.mode, run_id=wandb_run_id)
    summary = trainer.fit(logger, start_step)
    if export is not None:
        trainer.export(export, start_step if last_step is None else last_step)
    # Not on disk: no exit 0.
    trainer.state.on_rank0(lambda: write_results(trainer, logger, summary))
    return 0


def write_run_config(trainer: "Trainer") -> None:
    """config.yaml (the resolved config, with what the run uses) and overrides.yaml, in the run directory."""
    from trainer.run.storage import write_text_atomically

    run_dir = trainer.rt.run_dir
    write_text_atomically("config.yaml", run_dir / "config.yaml", OmegaConf.to_yaml(trainer.config))
    write_text_atomically("overrides.yaml", run_dir / "overrides.yaml", OmegaConf.to_yaml(hydra_overrides()))


def announce(trainer: "Trainer") -> None:
    """One line on the console; the resolved config in every rank's log file."""
    from trainer.run.runtime import print_once

    cfg, rt = trainer.plan.cfg, trainer.rt
    log.info("config:\n%s", OmegaConf.to_yaml(trainer.config))
    print_once(f"run {rt.run_dir} | recipe {cfg.recipe.name} ({trainer.recipe.data.source} data) | "
               f"mode {trainer.plan.mode} | {rt.world_size} x {rt.device.type} | "
               f"{trainer.steps_per_epoch} steps/epoch of {trainer.global_batch} samples")


def write_results(trainer: "Trainer", logger, summary) -> None:
    """The summary printed and written (results.json; eval.json for train.eval_only, which never
    replaces a run's results), after the metric rows a full disk held back."""
    from trainer.metrics.results import print_summary, write_json

    # From the end of the last step's work: results.json's alone (W&B has the rest).
    summary["time/after_last_step_s"] = time.perf_counter() - trainer.last_step_done
    print_summary(summary)
    logger.write_pending()
    write_json(trainer.rt.run_dir / ("eval.json" if trainer.plan.cfg.train.eval_only else "results.json"), summary)


def say_complete(trainer: "Trainer", done: int, export: Optional[Path] = None) -> None:
    from trainer.run.runtime import print_once

    results = trainer.rt.run_dir / "results.json"
    where = (f"results in {results}" if results.exists() else  # its final write failed (exit 5), or its export
             f"{results.name} could not be written at its end: its summary is the last row of metrics.jsonl")
    exported = f"; its trained model exported to {export}" if export is not None else ""
    print_once(f"run {trainer.rt.run_dir} is complete: {done} of {trainer.total_steps} steps done; {where}{exported}. "
               "Ask for more (train.epochs, train.max_steps) to continue it, or set run_dir=... for a new run")
