"""The trial capture (CUDA): one more step captured in isolation, as GraphedStep would, with
``capture_error_mode="global"`` and then "thread_local" if another thread broke it.

The capture is graphing/capture.py's ``capture``, with the doctor's call checks on in a mode that
records instead of reporting: which host syncs and copies the captured step still makes (a library
may skip them while a stream is capturing). Then a few replays are compared with as many eager
steps from the same state and inputs (replay_check.py); the model and optimizer are left as the
eager steps before the trial left them.
"""
from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from graphing.capture import capture, reset_rng_capture_state
from graphing.doctor.attribution import is_package_file, is_user_file
from graphing.doctor.findings import BLOCKS, Finding, Findings
from graphing.doctor.interception import CallInterceptor
from graphing.doctor.ranks import all_ranks_agree, laxest
from graphing.doctor.replay_check import ReplayComparison, StepState, compare, copies, tensors_of
from graphing.doctor.step_runner import StepRunner, on_side_stream
from graphing.executor import distributed
from graphing.options import render

__all__ = ["TrialCapture", "laxest", "recommended_mode", "try_captures"]


def recommended_mode() -> str:
    """thread_local when another thread may use CUDA during a capture (a pinned-memory loader), else global."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    return "thread_local" if any("pin_memory" in (t.name or "") for t in others) else "global"


@dataclass
class TrialCapture:
    mode: str  # the capture_error_mode it captured with (or the recommended one)
    summary: str  # what happened, in a line
    failure: Optional[Finding] = None  # a capture_failed finding
    captured: bool = False
    seen: Findings = field(default_factory=Findings)  # the checks' findings on the calls the capture ran
    replays: Optional[ReplayComparison] = None  # None: not compared


def try_captures(runner: StepRunner, optimizers: Sequence[torch.optim.Optimizer], replays: int = 0,
                 mutated: Sequence[torch.Tensor] = ()) -> TrialCapture:
    """Captures one step (global, then thread_local); with ``replays``, compares that many replays with eager
    steps (a collective under a process group: every rank calls it). ``mutated``: device tensors the step
    writes in place besides the model's and the optimizers' (saved and restored with them)."""
    batches = [runner.next_inputs() for _ in range(max(replays, 1))]
    state, eager = _eager_reference(runner, optimizers, batches, mutated) if replays > 0 else (None, None)
    failure, explanation = None, ""
    for mode in ("global", "thread_local"):
        seen = Findings()
        explanation, seconds, step_error, graph, staged, outputs = _capture_once(runner, optimizers, mode,
                                                                                 batches[0], seen)
        if explanation is None:
            trial = TrialCapture(mode, f"captured in {seconds:.2f} s with capture_error_mode={mode}", None, True,
                                 seen)
            break
        failure = failure or _capture_failed(explanation, step_error)
        low = explanation.lower()
        if "other thread" not in low and "invalidated" not in low:
            break  # the step itself is at fault: a laxer mode would not help
    if graph is None:
        trial = TrialCapture(recommended_mode(), f"failed: {explanation.splitlines()[0]}", failure, seen=seen)
    if replays > 0 and all_ranks_agree(graph is not None and eager is not None, runner.device):
        trial.replays = _replay(graph, runner, batches, staged, outputs, state, eager)
        trial.summary += f"; {trial.replays.describe()}" if trial.replays else \
            "; replays not compared (the inputs changed shape)"
    if state is not None:
        state.restore()  # the model and optimizer as the eager steps before the trial left them
    if graph is not None:
        graph.reset()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)  # the captured backward's .grad are the graph's
    return trial


_Reference = Tuple[List[List[torch.Tensor]], List[torch.Tensor]]  # each step's outputs, the parameters after


def _eager_reference(runner: StepRunner, optimizers: Sequence[torch.optim.Optimizer], batches: Sequence[Any],
                     mutated: Sequence[torch.Tensor]) -> Tuple[Optional[StepState], Optional[_Reference]]:
    """The eager steps that the replays are compared with, run from a saved state that is then restored."""
    state = None
    try:
        state = StepState(runner.model, optimizers, mutated, runner.device)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)  # as before the capture
        outputs = [copies(tensors_of(runner.run(runner.stage(batch)))) for batch in batches]
        params = copies(list(runner.model.parameters()))
    except torch.OutOfMemoryError:  # no room for the copies: the replays are not compared
        if state is not None:
            state.restore()
        return None, None
    state.restore()
    return state, (outputs, params)


def _replay(graph, runner: StepRunner, batches: Sequence[Any], staged: Sequence[Any], outputs: Sequence[Any],
            state: StepState, eager: _Reference) -> Optional[ReplayComparison]:
    """Replays the graph with each batch copied into the capture's input buffers; compared with ``eager``."""
    replayed = []
    state.restore()
    for batch in batches:
        now = runner.stage(batch)
        if any(isinstance(a, torch.Tensor) and a is not b for a, b in zip(now, staged)):
            break  # inputs of another shape: this graph cannot take them
        on_side_stream(graph.replay, runner.side)
        replayed.append(copies(tensors_of(outputs)))
    start = [t.float() for t, p in zip(state.saved, state.tensors) if isinstance(p, torch.nn.Parameter)]
    return compare(eager[0][:len(replayed)], replayed, eager[1], copies(list(runner.model.parameters())), start) \
        if len(replayed) == len(batches) else None


class _StepError:
    """What the step itself raised during the capture, the user line it came from, and the line of an
    installed package it was raised in (when it was)."""

    def __init__(self, err: BaseException, step_traceback):
        self.words = _words(err)
        self.place = ("", 0)
        self.library = ("", 0)
        for entry in reversed(traceback.extract_tb(step_traceback)):  # the step's frames, innermost first
            if is_user_file(entry.filename):
                self.place = os.path.abspath(entry.filename), entry.lineno or 0
                break
            if not self.library[0] and is_package_file(entry.filename):
                self.library = os.path.abspath(entry.filename), entry.lineno or 0


def _capture_once(runner: StepRunner, optimizers: Sequence[torch.optim.Optimizer], mode: str, inputs: Sequence[Any],
                  seen: Findings) -> Tuple[Optional[str], float, Optional[_StepError], Any, List[Any], Any]:
    """(failure explanation or None, seconds, what the step raised or None, the graph or None, the inputs it
    reads, what the step returned). ``seen`` gets the checks' findings on the calls the captured step made."""
    if distributed():
        dist.barrier()
    staged = runner.stage(inputs)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)  # backward then allocates .grad in the graph's pool, as GraphedStep does
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    raised: List[Tuple[BaseException, Any]] = []
    returned: List[Any] = []
    seen.step = 0
    calls = CallInterceptor(runner.device, seen, inspect_only=True)

    def step() -> None:
        try:
            with calls:
                returned.append(runner.call(staged))
        except Exception as err:  # kept with its traceback as of here: the frames below this one
            raised.append((err, err.__traceback__))
            raise

    graph, seconds, explanation = capture(step, runner.side, None, mode)
    seen.step = -1
    if graph is None:
        explanation = render(explanation)  # the doctor names graphing's settings by their own names
        try:
            reset_rng_capture_state(runner.side)
        except Exception:
            pass
        return explanation, seconds, _StepError(*raised[0]) if raised else None, None, staged, None
    return None, seconds, None, graph, staged, returned[0] if returned else None


def _capture_failed(explanation: str, step_error: Optional[_StepError]) -> Finding:
    """The finding for a failed capture, at the user line of the error that ``capture`` caught.

    That error is the step's own, or one that torch.cuda.graph raised on ending the capture (after
    the step's, which invalidated it), which no user line raised: its words come from the
    explanation's "underlying error" line.
    """
    underlying = explanation.split("underlying error: ", 1)[-1].splitlines()[0]
    library = ("", 0)
    if step_error is not None and underlying.startswith(step_error.words):
        words, (file, line), library = step_error.words, step_error.place, step_error.library
    else:
        kind, _, message = underlying.partition(": ")
        words, file, line = f"{kind}: {message[:200]}", "", 0
    cause = explanation.split("failed: ", 1)[-1].split("\n")[0]
    return Finding("capture_failed", BLOCKS, file, line, words, cause[:1].upper() + cause[1:],
                   library_file=library[0], library_line=library[1])


def _words(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
