"""What differs between eager steps: a graph replays one step, so an input, a path, a shape or a
Python number that changes from step to step is frozen at capture.

Each step's inputs and its torch calls from the user's code (place, output shapes, Python-number
arguments) are recorded while it runs; steps are compared afterwards, each with the last one
before it whose tensor inputs had the same shapes, from the second step on (the first may
differ: lazy initialisation). Inputs whose shapes vary are fine while they come in at most
``max_graphs`` shapes: GraphedStep captures a graph per shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch

from graphing.doctor.findings import BLOCKS, WRONG, Findings
from graphing.options import GraphOptions


@dataclass
class CallRecord:
    name: str
    file: str
    line: int
    shapes: Tuple
    scalars: Tuple
    library: Tuple[str, int] = ("", 0)  # the line inside an installed package, when the call was made in one

    @property
    def site(self) -> Tuple[str, int, str, int]:
        return (self.file, self.line, *self.library)


class StepRecords:
    """Each eager step's inputs and calls, and the findings from comparing them."""

    def __init__(self, findings: Findings, max_graphs: int = GraphOptions.max_graphs):
        self.findings, self.max_graphs = findings, max_graphs
        self.input_shapes: List[Tuple] = []  # the distinct shapes of the tensor inputs, in order of appearance
        self.inputs: List[List[Tuple]] = []
        self.calls: List[List[CallRecord]] = []
        self.data_dependent_shapes = False  # a mask op ran: later shapes follow the data, not compared

    def begin_step(self, inputs: Sequence[Any]) -> None:
        self.calls.append([])
        self.inputs.append([_describe(x) for x in inputs])

    def record_call(self, name: str, file: str, line: int, out, args, kwargs,
                    library: Tuple[str, int] = ("", 0)) -> None:
        self.calls[-1].append(CallRecord(name, file, line, _shapes(out), _scalars(args, kwargs), library))

    def compare_steps(self) -> None:
        """Findings from differences between steps, each dated with the later step."""
        last_with: Dict[Tuple, int] = {}  # input shapes -> the last step that had them
        for i in range(len(self.calls)):
            shapes = _tensor_shapes(self.inputs[i])
            if shapes not in self.input_shapes:
                self.input_shapes.append(shapes)
                if len(self.input_shapes) == self.max_graphs + 1:
                    self._too_many_shapes(i)
            if i >= 2:
                self.findings.step = i
                if _values(self.inputs[i]) != _values(self.inputs[i - 1]):
                    self._input_change(i)
                elif not self.data_dependent_shapes and shapes in last_with and last_with[shapes] >= 1:
                    self._call_change(self.calls[last_with[shapes]], self.calls[i], i)
            last_with[shapes] = i
        self.findings.step = -1

    def _too_many_shapes(self, i: int) -> None:
        site = next((d.site for c, d in zip(self.calls[0], self.calls[i]) if c.shapes != d.shapes), None)
        site = site or next((c.site for c in self.calls[i]), ("", 0, "", 0))
        self.findings.step = i
        self.findings.add("shape_change", BLOCKS, *site[:2],
                          f"the inputs came in a {len(self.input_shapes)}th set of shapes at step {i} "
                          f"({_show_inputs(self.inputs[i])}), more than max_graphs={self.max_graphs} graphs, one "
                          "per shape", library=site[2:])

    def _input_change(self, i: int) -> None:
        """An input that is not a tensor changed (or stopped or started being one): captured as it was."""
        before, after = self.inputs[i - 1], self.inputs[i]
        vb, va = _values(before), _values(after)
        changed = next(k for k in range(max(len(vb), len(va))) if k >= len(vb) or k >= len(va) or vb[k] != va[k])
        was = before[changed] if changed < len(before) else "nothing"
        now = after[changed] if changed < len(after) else "nothing"
        site = next((c.site for c in self.calls[i]), ("", 0, "", 0))
        self.findings.add("shape_change", BLOCKS, *site[:2],
                          f"input {changed} changed from {_show(was)} to {_show(now)} at step {i}; a graph replays "
                          "the Python values it was captured with",
                          "Pass values that change as tensors (GraphedStep copies tensors into its buffers).",
                          library=site[2:])

    def _call_change(self, a: List[CallRecord], b: List[CallRecord], i: int) -> None:
        sites_a = {c.site for c in a}
        sites_b = {c.site for c in b}
        if [(c.name, c.site) for c in a] != [(c.name, c.site) for c in b]:
            only = [c for c in b if c.site not in sites_a] + [c for c in a if c.site not in sites_b]
            if not only:
                only = [d for c, d in zip(a, b) if (c.name, c.site) != (d.name, d.site)] or b[len(a):]
            first = only[0] if only else (b or a)[0]
            if first.site not in self.findings.sites():
                self.findings.add("control_flow", WRONG, first.file, first.line,
                                  f"steps {i - 1} and {i} ran different torch calls from here: a Python-side branch "
                                  "or loop that changes between steps (the graph replays the path taken at capture)",
                                  library=first.library)
            return
        for c, d in zip(a, b):
            if c.shapes != d.shapes:
                self.findings.add("shape_change", WRONG, d.file, d.line,
                                  f"{d.name} made shape {_show_shapes(c.shapes)} at step {i - 1} and "
                                  f"{_show_shapes(d.shapes)} at step {i} with the same inputs: a shape decided by "
                                  "Python state",
                                  "Keep shapes fixed: compute sizes from values that never change between steps.",
                                  library=d.library)
                return
        for c, d in zip(a, b):
            if c.scalars != d.scalars:
                changed = [(x, y) for x, y in zip(c.scalars, d.scalars) if x != y][:1]
                value = f" ({changed[0][0]!r} then {changed[0][1]!r})" if changed else ""
                self.findings.add("python_scalar", WRONG, d.file, d.line,
                                  f"a Python number passed to {d.name} here changes between steps{value}",
                                  library=d.library)
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


def _tensor_shapes(inputs: List[Tuple]) -> Tuple:
    """The tensor inputs' shapes and dtypes: what picks a graph."""
    return tuple(d[1:] if d[0] == "tensor" else None for d in inputs)


def _values(inputs: List[Tuple]) -> Tuple:
    """Everything about the inputs that a graph captures as it was: which are tensors, the other values."""
    return tuple(("tensor",) if d[0] == "tensor" else d for d in inputs)


def _show_inputs(inputs: List[Tuple]) -> str:
    return ", ".join(_show(d) for d in inputs)


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
