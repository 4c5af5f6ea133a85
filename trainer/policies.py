"""When the loop reads metrics, checkpoints and evaluates: small policies it asks.

Each answers for one ``StepPoint`` (where the loop stands after a step) without touching
the device. When to stop early (SIGTERM) is the ranks' agreement in trainer/run/stop.py.
"""
from __future__ import annotations

import time
from typing import NamedTuple


class StepPoint(NamedTuple):  # made every step: a tuple is the cheapest record
    step: int  # optimizer steps done
    epoch: int  # 0-based epoch the step belongs to
    epoch_end: bool  # the epoch's last step
    last: bool  # the run's last step


class LogPolicy:
    """Metrics are read every ``every`` steps, at each epoch's end and at the last step."""

    def __init__(self, every: int):
        self.every = every

    def due(self, at: StepPoint) -> bool:
        return at.step % self.every == 0 or at.epoch_end or at.last


class CheckpointPolicy:
    """A checkpoint at the last step and whenever one of ``checkpoint.every_*`` is due (0 turns one off).

    Steps and epochs are known to every rank alike. Minutes are rank 0's clock, so they are
    agreed on: ``clock_vote`` goes into the metrics' all-reduce at the next log interval.
    """

    def __init__(self, every_steps: int, every_epochs: int, every_minutes: float, is_main: bool,
                 enabled: bool = True):
        self.enabled = enabled  # checkpoint.save=false: never due, not even at the end or on SIGTERM
        self.every_steps, self.every_epochs = every_steps, every_epochs
        self.every_s = 60 * every_minutes
        self.is_main = is_main
        self.last_saved_at = time.monotonic()

    def due(self, at: StepPoint) -> bool:
        by_epoch = at.epoch_end and self.every_epochs > 0 and (at.epoch + 1) % self.every_epochs == 0
        return self.enabled and (at.last or (self.every_steps > 0 and at.step % self.every_steps == 0) or by_epoch)

    def clock_vote(self) -> float:
        """1.0 when rank 0's clock says a checkpoint is due (other ranks vote 0)."""
        due = self.enabled and self.is_main and self.every_s > 0 and time.monotonic() - self.last_saved_at >= self.every_s
        return 1.0 if due else 0.0

    def saved(self) -> None:
        self.last_saved_at = time.monotonic()


class EvalPolicy:
    """The whole test set after each epoch and after the run's last step (``train.eval``)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def due(self, at: StepPoint) -> bool:
        return self.enabled and (at.epoch_end or at.last)
