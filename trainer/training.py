"""One training run, as ``python train.py`` runs it, on one page.

    plan → process group → build → resume → fit → results → teardown

The Trainer (trainer/trainer.py) builds the run and runs its loop; the step order itself is
trainer/step.py (``TrainStep.__call__``).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from trainer.process import hydra_overrides
from trainer.results import print_summary, write_json
from trainer.runtime import print_once
from trainer.session import Session
from trainer.storage import write_text_atomically

if TYPE_CHECKING:
    from trainer.trainer import Trainer

log = logging.getLogger("train")


def train(cfg) -> int:
    """Trains as ``cfg`` says; returns the process's exit code (0: done)."""
    return Session(cfg).execute(fit_job)  # plan, join, the job; teardown in reverse; an error becomes a code


def fit_job(session: Session) -> int:
    """The training job, after the plan and the join: build, resume, fit, results."""
    cfg = session.cfg
    trainer = session.build()  # recipe, model, executor, optimizer, loaders, steps, checkpointable state
    start_step, wandb_run_id = trainer.resume(cfg.checkpoint)  # before any warm-up or capture
    if start_step >= trainer.total_steps and not cfg.train.eval_only:
        say_complete(trainer, start_step)  # a finished run is left alone
        return 0
    session.open_run_dir()
    trainer.state.on_rank0(lambda: write_run_config(trainer))
    announce(trainer)
    logger = session.open_logger(trainer.config, job_type=trainer.plan.mode, run_id=wandb_run_id)
    summary = trainer.fit(logger, start_step)
    # Not on disk: no exit 0.
    trainer.state.on_rank0(lambda: write_results(trainer, logger, summary))
    return 0


def write_run_config(trainer: "Trainer") -> None:
    """config.yaml (the resolved config, with what the run uses) and overrides.yaml, in the run directory."""
    run_dir = trainer.rt.run_dir
    write_text_atomically("config.yaml", run_dir / "config.yaml", OmegaConf.to_yaml(trainer.config))
    write_text_atomically("overrides.yaml", run_dir / "overrides.yaml", OmegaConf.to_yaml(hydra_overrides()))


def announce(trainer: "Trainer") -> None:
    """One line on the console; the resolved config in every rank's log file."""
    cfg, rt = trainer.plan.cfg, trainer.rt
    log.info("config:\n%s", OmegaConf.to_yaml(trainer.config))
    print_once(f"run {rt.run_dir} | recipe {cfg.recipe.name} ({trainer.recipe.data.source} data) | "
               f"mode {trainer.plan.mode} | {rt.world_size} x {rt.device.type} | "
               f"{trainer.steps_per_epoch} steps/epoch of {trainer.global_batch} samples")


def write_results(trainer: "Trainer", logger, summary) -> None:
    """The summary printed and written (results.json; eval.json for train.eval_only, which never
    replaces a run's results), after the metric rows a full disk held back."""
    # From the end of the last step's work: results.json's alone (W&B has the rest).
    summary["time/after_last_step_s"] = time.perf_counter() - trainer.last_step_done
    print_summary(summary)
    logger.write_pending()
    write_json(trainer.rt.run_dir / ("eval.json" if trainer.plan.cfg.train.eval_only else "results.json"), summary)


def say_complete(trainer: "Trainer", done: int) -> None:
    results = trainer.rt.run_dir / "results.json"
    where = (f"results in {results}" if results.exists() else  # its final write failed (exit 5)
             f"{results.name} could not be written at its end: its summary is the last row of metrics.jsonl")
    print_once(f"run {trainer.rt.run_dir} is complete: {done} of {trainer.total_steps} steps done; {where}. "
               "Ask for more (train.epochs, train.max_steps) to continue it, or set run_dir=... for a new run")
