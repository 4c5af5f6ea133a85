"""The capture attempt (CUDA): one more step captured in isolation, as GraphedStep would, with
``capture_error_mode="global"`` and then "thread_local" if another thread broke it.

The capture is graphing/capture.py's ``capture``; the graph is never replayed, so the model is left
as the eager steps left it.
"""
from __future__ import annotations

import os
import threading
import traceback
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from graphing.capture import capture, reset_rng_capture_state
from graphing.doctor.attribution import is_user_file
from graphing.doctor.findings import BLOCKS, Finding
from graphing.doctor.step_runner import StepRunner
from graphing.executor import distributed
from graphing.options import CaptureErrorMode, render

_STRICT_FIRST = [m.value for m in CaptureErrorMode]  # global, thread_local, relaxed


def laxest(modes: Sequence[str]) -> str:
    return max(modes, key=_STRICT_FIRST.index)


def recommended_mode() -> str:
    """thread_local when another thread may use CUDA during a capture (a pinned-memory loader), else global."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    return "thread_local" if any("pin_memory" in (t.name or "") for t in others) else "global"


def try_captures(runner: StepRunner, optimizers: Sequence[torch.optim.Optimizer]
                 ) -> Tuple[str, str, Optional[Finding]]:
    """(the mode it captured with, what happened, a capture_failed finding or None)."""
    failure = None
    for mode in ("global", "thread_local"):
        explanation, seconds, step_error = _capture_once(runner, optimizers, mode)
        if explanation is None:
            return mode, f"captured in {seconds:.2f} s with capture_error_mode={mode}", None
        failure = failure or _capture_failed(explanation, step_error)
        low = explanation.lower()
        if "other thread" not in low and "invalidated" not in low:
            break  # the step itself is at fault: a laxer mode would not help
    return recommended_mode(), f"failed: {explanation.splitlines()[0]}", failure


class _StepError:
    """What the step itself raised during the capture, and the user line it came from."""

    def __init__(self, err: BaseException, step_traceback):
        self.words = _words(err)
        self.place = ("", 0)
        for entry in reversed(traceback.extract_tb(step_traceback)):  # the step's frames, innermost first
            if is_user_file(entry.filename):
                self.place = os.path.abspath(entry.filename), entry.lineno or 0
                break


def _capture_once(runner: StepRunner, optimizers: Sequence[torch.optim.Optimizer], mode: str
                  ) -> Tuple[Optional[str], float, Optional[_StepError]]:
    """(failure explanation or None, seconds, what the step raised or None)."""
    if distributed():
        dist.barrier()
    staged = runner.stage(runner.next_inputs())
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)  # backward then allocates .grad in the graph's pool, as GraphedStep does
    torch.cuda.synchronize(runner.device)
    raised: List[Tuple[BaseException, Any]] = []

    def step() -> None:
        try:
            runner.call(staged)
        except Exception as err:  # kept with its traceback as of here: the frames below this one
            raised.append((err, err.__traceback__))
            raise

    graph, seconds, explanation = capture(step, runner.side, None, mode)
    if graph is None:
        explanation = render(explanation)  # the doctor names graphing's settings by their own names
        try:
            reset_rng_capture_state(runner.side)
        except Exception:
            pass
        return explanation, seconds, _StepError(*raised[0]) if raised else None
    graph.reset()  # recorded, never replayed: the model is left as the eager steps left it
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)  # the captured backward's .grad were never computed
    return None, seconds, None


def _capture_failed(explanation: str, step_error: Optional[_StepError]) -> Finding:
    """The finding for a failed capture, at the user line of the error that ``capture`` caught.

    That error is the step's own, or one that torch.cuda.graph raised on ending the capture (after
    the step's, which invalidated it), which no user line raised: its words come from the
    explanation's "underlying error" line.
    """
    underlying = explanation.split("underlying error: ", 1)[-1].splitlines()[0]
    if step_error is not None and underlying.startswith(step_error.words):
        words, (file, line) = step_error.words, step_error.place
    else:
        kind, _, message = underlying.partition(": ")
        words, file, line = f"{kind}: {message[:200]}", "", 0
    cause = explanation.split("failed: ", 1)[-1].split("\n")[0]
    return Finding("capture_failed", BLOCKS, file, line, words, cause[:1].upper() + cause[1:])


def _words(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
