"""One training run, as ``python train.py`` runs it, on one page.

    plan → process group → build → resume → fit → results → teardown

The step order itself is trainer/step.py (``TrainStep.__call__``); the loop around it, with
its logging, checkpoint and evaluation policies, is trainer/loop.py.
"""
from __future__ import annotations

import logging
import time

from omegaconf import OmegaConf

from trainer.assembly import Run
from trainer.loop import TrainingLoop
from trainer.process import hydra_overrides
from trainer.results import print_summary, write_json
from trainer.runtime import print_once
from trainer.session import Session
from trainer.storage import write_text_atomically

log = logging.getLogger("train")


def train(cfg) -> int:
    """Trains as ``cfg`` says; returns the process's exit code (0: done)."""
    with Session(cfg) as session:  # on every path: teardown in reverse; an error becomes one message and a code
        session.plan()  # every check that needs no data, before the ranks meet
        session.join()  # process group, the run directory all ranks agree on, logging, seeds
        run = session.build()  # recipe, model, executor, optimizer, loaders, steps, checkpointable state
        start_step, wandb_run_id = run.state.resume(cfg.checkpoint)  # before any warm-up or capture
        if start_step >= run.total_steps and not cfg.train.eval_only:
            say_complete(run, start_step)  # a finished run is left alone
            return 0
        session.open_run_dir()
        run.state.on_rank0(lambda: write_run_config(run))
        announce(run)
        logger = session.open_logger(run.config, job_type=run.plan.mode, run_id=wandb_run_id)
        loop = TrainingLoop(run, logger, start_step)
        summary = loop.fit()
        # Not on disk: no exit 0.
        run.state.on_rank0(lambda: write_results(run, logger, summary, loop.last_step_done))
    return session.exit_code


def write_run_config(run: Run) -> None:
    """config.yaml (the resolved config, with what the run uses) and overrides.yaml, in the run directory."""
    run_dir = run.rt.run_dir
    write_text_atomically("config.yaml", run_dir / "config.yaml", OmegaConf.to_yaml(run.config))
    write_text_atomically("overrides.yaml", run_dir / "overrides.yaml", OmegaConf.to_yaml(hydra_overrides()))


def announce(run: Run) -> None:
    """One line on the console; the resolved config in every rank's log file."""
    cfg, rt = run.plan.cfg, run.rt
    log.info("config:\n%s", OmegaConf.to_yaml(run.config))
    print_once(f"run {rt.run_dir} | recipe {cfg.recipe.name} ({run.recipe.data.source} data) | "
               f"mode {run.plan.mode} | {rt.world_size} x {rt.device.type} | "
               f"{run.steps_per_epoch} steps/epoch of {run.global_batch} samples")


def write_results(run: Run, logger, summary, last_step_done: float) -> None:
    """The summary printed and written (results.json; eval.json for train.eval_only, which never
    replaces a run's results), after the metric rows a full disk held back. ``last_step_done``
    (perf_counter): when the last step's work ended, for ``time/after_last_step_s``."""
    summary["time/after_last_step_s"] = time.perf_counter() - last_step_done  # results.json's alone: W&B has the rest
    print_summary(summary)
    logger.write_pending()
    write_json(run.rt.run_dir / ("eval.json" if run.plan.cfg.train.eval_only else "results.json"), summary)


def say_complete(run: Run, done: int) -> None:
    results = run.rt.run_dir / "results.json"
    where = (f"results in {results}" if results.exists() else  # its final write failed (exit 5)
             f"{results.name} could not be written at its end: its summary is the last row of metrics.jsonl")
    print_once(f"run {run.rt.run_dir} is complete: {done} of {run.total_steps} steps done; {where}. "
               "Ask for more (train.epochs, train.max_steps) to continue it, or set run_dir=... for a new run")
