"""One training step of a built run, as train.py's loop runs it (trainer/loop.py): staged by
the train loader, run by the executor as the epoch's full step. The benchmarks time this, so
that what they measure is the step train.py takes, warm-up and capture included.
"""
from __future__ import annotations

from functools import partial

from graphing import StepRole


def run_train_step(run) -> None:
    """Stages and runs one full training step of ``run`` (trainer.assembly's built run)."""
    layout = run.train_loader.plan.full
    run.executor.run(StepRole.train, run.train_loader.stage, partial(run.train_step, layout), layout)


def train_phase(run) -> str:
    """What the next full training step will be: warmup, eager, capture or graph."""
    return run.executor.phase(StepRole.train, run.train_loader.plan.full)


def warm_up(run) -> None:
    """Starts epoch 0 and takes steps until the warm-up and the capture (graph modes) are done."""
    run.train_loader.start_epoch(0)
    while train_phase(run) in ("warmup", "capture"):
        run_train_step(run)
