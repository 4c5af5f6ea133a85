"""What differs between eager steps: a graph replays one step, so an input, a path, a shape or a
Python number that changes from step to step is frozen at capture.

Each step's inputs and its torch calls from the user's code (place, output shapes, Python-number
arguments) are recorded while it runs; consecutive steps are compared afterwards, from the
second to the third on (the first may differ: lazy initialisation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import torch

from graphing.doctor.findings import BLOCKS, WRONG, Findings


@dataclass
class CallRecord:
    name: str
    file: str
    line: int
    shapes: Tuple
    scalars: Tuple


class StepRecords:
    """Each eager step's inputs and calls, and the findings from comparing them."""

    def __init__(self, findings: Findings):
        self.findings = findings
        self.inputs: List[List[Tuple]] = []
        self.calls: List[List[CallRecord]] = []
        self.data_dependent_shapes = False  # a mask op ran: later shapes follow the data, not compared

    def begin_step(self, inputs: Sequence[Any]) -> None:
        self.calls.append([])
        self.inputs.append([_describe(x) for x in inputs])

    def record_call(self, name: str, file: str, line: int, out, args, kwargs) -> None:
        self.calls[-1].append(CallRecord(name, file, line, _shapes(out), _scalars(args, kwargs)))

    def compare_steps(self) -> None:
        """Findings from differences between consecutive steps, each dated with the later step."""
        for i in range(2, len(self.calls)):
            self.findings.step = i
            if self.inputs[i] != self.inputs[i - 1]:
                self._input_change(i)
            elif not self.data_dependent_shapes:
                self._call_change(self.calls[i - 1], self.calls[i], i)
        self.findings.step = -1

    def _input_change(self, i: int) -> None:
        before, after = self.inputs[i - 1], self.inputs[i]
        changed = next(k for k in range(max(len(before), len(after)))
                       if k >= len(before) or k >= len(after) or before[k] != after[k])
        was = before[changed] if changed < len(before) else "nothing"
        now = after[changed] if changed < len(after) else "nothing"
        a, b = self.calls[i - 1], self.calls[i]
        site = next(((c.file, c.line) for c, d in zip(a, b) if c.shapes != d.shapes), None)
        site = site or next(((c.file, c.line) for c in b), ("", 0))
        what = f"input {changed} changed from {_show(was)} to {_show(now)} at step {i}"
        if was[0] == "tensor" and now[0] == "tensor":
            self.findings.add("shape_change", BLOCKS, *site, what + "; a graph replays the shapes it was captured "
                              "with")
        else:
            self.findings.add("shape_change", BLOCKS, *site, what + "; a graph replays the Python values it was "
                              "captured with", "Pass values that change as tensors (GraphedStep copies tensors into "
                              "its buffers).")

    def _call_change(self, a: List[CallRecord], b: List[CallRecord], i: int) -> None:
        sites_a = {(c.file, c.line) for c in a}
        sites_b = {(c.file, c.line) for c in b}
        if [(c.name, c.file, c.line) for c in a] != [(c.name, c.file, c.line) for c in b]:
            only = [c for c in b if (c.file, c.line) not in sites_a] + [c for c in a if (c.file, c.line) not in sites_b]
            if not only:
                only = [d for c, d in zip(a, b) if (c.name, c.file, c.line) != (d.name, d.file, d.line)] or b[len(a):]
            first = only[0] if only else (b or a)[0]
            if (first.file, first.line) not in self.findings.places():
                self.findings.add("control_flow", WRONG, first.file, first.line,
                                  f"steps {i - 1} and {i} ran different torch calls from here: a Python-side branch "
                                  "or loop that changes between steps (the graph replays the path taken at capture)")
            return
        for c, d in zip(a, b):
            if c.shapes != d.shapes:
                self.findings.add("shape_change", WRONG, d.file, d.line,
                                  f"{d.name} made shape {_show_shapes(c.shapes)} at step {i - 1} and "
                                  f"{_show_shapes(d.shapes)} at step {i} with the same inputs: a shape decided by "
                                  "Python state",
                                  "Keep shapes fixed: compute sizes from values that never change between steps.")
                return
        for c, d in zip(a, b):
            if c.scalars != d.scalars:
                changed = [(x, y) for x, y in zip(c.scalars, d.scalars) if x != y][:1]
                value = f" ({changed[0][0]!r} then {changed[0][1]!r})" if changed else ""
                self.findings.add("python_scalar", WRONG, d.file, d.line,
                                  f"a Python number passed to {d.name} here changes between steps{value}")
                return


def _shapes(out) -> Tuple:
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape),)
    if isinstance(out, (tuple, list)):
        return tuple(tuple(o.shape) for o in out if isinstance(o, torch.Tensor))
    return ()


def _scalars(args, kwargs) -> Tuple:
    out: List[Any] = []

    def add(v, depth):
        if isinstance(v, bool) or isinstance(v, (int, float)):
            out.append(v)
        elif isinstance(v, slice):
            out.append((v.start, v.stop, v.step) if all(isinstance(x, (int, type(None))) for x in
                                                          (v.start, v.stop, v.step)) else "slice")
        elif isinstance(v, (tuple, list)) and depth == 0:
            for x in v:
                add(x, 1)

    for a in args:
        add(a, 0)
    for k in sorted(kwargs):
        add(kwargs[k], 0)
    return tuple(out)


def _describe(x) -> Tuple:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype))
    if isinstance(x, (bool, int, float, str, type(None))):
        return ("value", x)
    return ("object", type(x).__name__)


def _show(d) -> str:
    if isinstance(d, tuple) and d and d[0] == "tensor":
        return f"{list(d[1])} {d[2].replace('torch.', '')}"
    if isinstance(d, tuple) and d and d[0] == "value":
        return repr(d[1])
    return str(d)


def _show_shapes(shapes: Tuple) -> str:
    return ", ".join(str(list(s)) for s in shapes) or "()"
