"""The graph doctor's checks: what it watches while the step runs eagerly, and what it makes of it.

Everything here works on the CPU as well as on CUDA; graphing/doctor.py adds what needs a GPU
(CUDA's own sync detection, device memory, the capture attempt, the profile).

- A ``TorchFunctionMode`` sees every torch call the step makes from Python. Calls that read a
  device value on the host (``.item()``, ``print(tensor)``, a tensor in an ``if``, a boolean
  mask, ``.cpu()``), copy a Python value to the device (``torch.tensor(0.5, device=...)``) or
  draw from a generator of the device other than the default one are findings at once. Every
  other call is recorded with its place, its output shapes and its Python-number arguments, so
  that steps can be compared: a graph replays one step, so a path, a shape or a number that
  changes from step to step is frozen at capture.
- The place of a call is the innermost frame outside torch, the standard library, installed
  packages and the doctor: a line of the user's code, of a recipe, or of trainer/. Calls made
  inside torch's own DDP, optimizers, data loading or compile machinery are left out: they are
  checked as a whole (DDP's settings, the optimizer's capturability), and DDP's early host
  syncs stop after its warm-up.
- Line tracing (``sys.settrace``, user frames only) finds the line that writes a Python number
  into an optimizer's ``lr``; weak references find tensors that the step keeps from step to step.
"""
from __future__ import annotations

import ast
import functools
import gc
import inspect
import os
import site
import sys
import sysconfig
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode

# ---- the kinds of finding ---------------------------------------------------------------------

BLOCKS, WRONG = "blocks", "wrong"  # capture fails / captures, then replays a frozen or wrong step

FIXES: Dict[str, str] = {
    "host_sync": "Keep the value on the device inside the step (accumulate it in a device tensor) and read "
                 "it outside the step, at a log interval.",
    "host_to_device_copy": "Make the tensor once, outside the step, as a device buffer that you update in place "
                           "(or use the Python number directly as an operand, e.g. `loss * 0.5`).",
    "shape_change": "Give every step the same shapes: drop or pad the last partial batch (drop_last=True).",
    "control_flow": "Make every step take the same path: select with tensors (torch.where, a 0/1 weight) "
                    "instead of a Python `if` on state that changes between steps.",
    "python_scalar": "Keep a value that changes between steps in a device tensor updated in place: the graph "
                     "keeps the Python number it saw at capture.",
    "lr_frozen": "Build the optimizer with lr=torch.tensor(lr, device=...) and write the schedule into it in "
                 "place (group['lr'].fill_(value), or a device-side schedule such as trainer/schedules.py).",
    "optimizer": "Build the optimizer with capturable=True (or fused=True); graphing.graph_safe_optimizer_kwargs "
                 "gives the arguments.",
    "grad_scaler": "Train in bf16 without a GradScaler, or give the scaler a fused optimizer (fused=True), "
                   "which checks for infs on the device.",
    "autocast_cache": "Enter autocast inside the step (or pass cache_enabled=False), so that no weight cast "
                      "cached before the step is read by the graph.",
    "ddp_find_unused_parameters": "Build DDP with find_unused_parameters=False and let every parameter reach "
                                  "the loss (or set requires_grad=False on the ones that never do).",
    "sync_batchnorm": "Use BatchNorm (or GroupNorm) in the graphed step: this torch's SyncBatchNorm syncs with "
                      "the host while capturing.",
    "unregistered_generator": "Draw from the default generator (seeded by torch.manual_seed), which every replay "
                              "advances; a generator of your own must be registered with the graph "
                              "(CUDAGraph.register_generator_state).",
    "memory_growth": "Do not keep a tensor per step in Python (a list of losses, a history): add into a "
                     "preallocated device tensor instead, which replays keep updating.",
    "capture_failed": "Fix the call named here (the message says why), or keep this step eager.",
}

_SYNC_WHAT = {
    "item": "Tensor.item() reads a device value on the host",
    "tolist": "Tensor.tolist() copies to the host",
    "numpy": "Tensor.numpy() copies to the host",
    "cpu": "Tensor.cpu() copies to the host",
    "to": "Tensor.to('cpu') copies to the host",
    "copy_": "copy_ from the device into a host tensor",
    "__bool__": "a tensor used as a Python bool (`if tensor`, `and`/`or`, `assert`)",
    "is_nonzero": "a tensor used as a Python bool",
    "__int__": "int(tensor) reads a device value on the host",
    "__float__": "float(tensor) reads a device value on the host",
    "__index__": "a tensor used as a Python index",
    "__complex__": "complex(tensor) reads a device value on the host",
    "__repr__": "print/repr of a tensor reads its values on the host",
    "__str__": "print/str of a tensor reads its values on the host",
    "__format__": "formatting a tensor (f-string, print) reads its value on the host",
    "equal": "torch.equal returns a Python bool: it waits for the device",
    "allclose": "torch.allclose returns a Python bool: it waits for the device",
    "nonzero": "nonzero: the output's size depends on the data, so the host waits for it",
    "argwhere": "argwhere: the output's size depends on the data, so the host waits for it",
    "masked_select": "masked_select: the output's size depends on the data, so the host waits for it",
    "unique": "unique: the output's size depends on the data, so the host waits for it",
    "unique_consecutive": "unique_consecutive: the output's size depends on the data",
    "bincount": "bincount: the output's size depends on the data",
    "repeat_interleave": "repeat_interleave with tensor repeats and no output_size: data-dependent size",
    "where": "torch.where(condition) with one argument: data-dependent size",
    "__getitem__": "indexing with a boolean mask: the output's size depends on the data",
}
_SYNC_FIX = {
    "__bool__": "Replace the Python `if` on a tensor with device-side selection (torch.where, a 0/1 weight), or "
                "decide outside the step.",
    "mask": "Use a fixed-shape form: torch.where(mask, x, 0), masked_fill, or a product with the mask "
            "(and divide by mask.sum() for a mean).",
    "copy": "Leave the tensor on the device inside the step; copy it to the host outside the step.",
}
_MASK_OPS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
             "repeat_interleave", "where", "__getitem__"}
_VALUE_SYNCS = {"item", "tolist", "numpy", "__bool__", "is_nonzero", "__int__", "__float__", "__index__",
                "__complex__", "__repr__", "__str__", "__format__", "equal", "allclose"}
_RANDOM_WITH_GENERATOR = "generator"
# Metadata reads: no device work, nothing to check, not worth a frame walk.
_METADATA = {"__get__", "__set__", "dim", "size", "stride", "numel", "data_ptr", "is_contiguous", "element_size",
             "__len__", "storage_offset", "is_floating_point", "is_complex", "get_device", "nelement", "ndimension",
             "__hash__", "has_names", "is_pinned"}


@dataclass
class Finding:
    """One problem, at the place in the user's code (or recipe, or trainer/) that causes it."""

    kind: str
    effect: str  # BLOCKS: capture fails; WRONG: it captures, and replays a frozen or wrong step
    file: str = ""  # absolute path; "" when no single line is to blame
    line: int = 0
    what: str = ""  # what was seen, in a phrase
    fix: str = ""  # the fix, in one sentence
    step: Optional[int] = None  # the first eager step (0-based) where it was seen
    ranks: List[int] = field(default_factory=list)

    @property
    def where(self) -> str:
        if not self.file:
            return "-"
        path = self.file
        try:
            rel = os.path.relpath(path)
            if not rel.startswith(".."):
                path = rel
        except ValueError:  # another drive
            pass
        return f"{path}:{self.line}"

    @property
    def key(self) -> Tuple[str, str, int]:
        return (self.kind, self.file, self.line)


# ---- where a call comes from ------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _library_dirs() -> Tuple[str, ...]:
    paths = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.add(os.path.abspath(p) + os.sep)
    try:
        paths.update(os.path.abspath(p) + os.sep for p in site.getsitepackages())
    except AttributeError:  # some virtualenvs
        pass
    paths.add(_TORCH_DIR)
    return tuple(sorted(paths))


_LIBRARY_DIRS = _library_dirs()
_DOCTOR_FILES = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "doctor.py")}

# torch's own machinery whose calls are checked as a whole, not call by call: DDP (its host syncs
# stop after its warm-up), optimizers (capturability is checked on the object), data loading,
# compile, CUDA utilities. Matched against paths relative to torch's package directory.
_IGNORED_TORCH = ("nn/parallel/", "distributed/", "optim/", "_dynamo/", "_inductor/", "utils/data/", "profiler/",
                  "autograd/profiler", "_functorch/", "cuda/__init__", "cuda/graphs", "cuda/memory", "cuda/streams")
_SCALER_TORCH = ("amp/grad_scaler", "cuda/amp/grad_scaler")
_QUIET_TORCH = ("amp/", "cuda/amp/")  # autocast and scaler bookkeeping: not compared between steps


@functools.lru_cache(maxsize=None)
def syncbn_syncs_while_capturing() -> bool:
    """True when this torch's SyncBatchNorm makes its host sync during a CUDA graph capture too.

    Recent torch (2.11 included) skips the sync (a boolean mask over gathered counts) while the
    stream is capturing; its eager steps still make it, which is then no finding.
    """
    try:
        from torch.nn.modules import _functions
        return "is_current_stream_capturing" not in inspect.getsource(_functions.SyncBatchNorm.forward)
    except (ImportError, AttributeError, OSError, TypeError):
        return True


@functools.lru_cache(maxsize=None)
def classify_file(filename: str) -> Tuple[str, Optional[str]]:
    """("user" | "doctor" | "library", tag) where tag is "ignore", "scaler", "quiet" or None."""
    if filename.startswith("<frozen"):
        return "library", None
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path in _DOCTOR_FILES:
        return "doctor", None
    if path.startswith(_TORCH_DIR):
        rel = path[len(_TORCH_DIR):].replace(os.sep, "/")
        if rel.startswith(_SCALER_TORCH):
            return "library", "scaler"
        ignored = _IGNORED_TORCH + (() if syncbn_syncs_while_capturing() else ("nn/modules/_functions",))
        if rel.startswith(ignored):
            return "library", "ignore"
        if rel.startswith(_QUIET_TORCH):
            return "library", "quiet"
        return "library", None
    if path.startswith(_LIBRARY_DIRS) or f"{os.sep}site-packages{os.sep}" in path \
            or f"{os.sep}dist-packages{os.sep}" in path:
        return "library", None
    return "user", None


def user_site(frame) -> Tuple[Optional[Any], Optional[str]]:
    """(innermost user frame at or above ``frame``, tag of the innermost tagged library frame below it)."""
    tag = None
    while frame is not None:
        kind, frame_tag = classify_file(frame.f_code.co_filename)
        if kind == "user":
            return frame, tag
        if tag is None and frame_tag is not None:
            tag = frame_tag
        frame = frame.f_back
    return None, tag


def enclosing_autocast_with(filename: str, line: int) -> Optional[int]:
    """The line of the innermost ``with ...autocast...`` statement around ``line`` in ``filename``, or None."""
    tree = _parse(filename)
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.With, ast.AsyncWith)) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if any("autocast" in ast.unparse(item.context_expr).lower() for item in node.items):
                if best is None or node.lineno > best:
                    best = node.lineno
    return best


@functools.lru_cache(maxsize=64)
def _parse(filename: str):
    try:
        with open(filename, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None


# ---- the watch --------------------------------------------------------------------------------

@dataclass
class _Call:
    name: str
    file: str
    line: int
    shapes: Tuple
    scalars: Tuple


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


def _device_of(value) -> Optional[torch.device]:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return None


class Checks(TorchFunctionMode):
    """Watches the eager steps (a torch function mode); ``found`` holds what it saw. One per diagnosis."""

    def __init__(self, device: torch.device, optimizers: Sequence[torch.optim.Optimizer]):
        super().__init__()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.optimizers = list(optimizers)
        self.found: Dict[Tuple[str, str, int], Finding] = {}
        self.step = -1
        self.traces: List[List[_Call]] = []
        self.inputs: List[List[Tuple]] = []
        self.lr_at_step: List[Optional[Tuple]] = []  # each step's first optimizer.step(): its groups' lr
        self.step_call_site: Optional[Tuple[str, int]] = None
        self.lr_set_lines: Dict[Tuple, Tuple[str, int]] = {}
        self.made: List[Tuple[Any, int, str, int]] = []  # (weakref, step, file, line)
        self.default_generators = [torch.default_generator]
        if self.cuda:
            self.default_generators += list(torch.cuda.default_generators)
        self.data_dependent_shapes = False
        self.in_backward = False
        self.ddp_syncs_in_backward = False  # find_unused_parameters: named once as its own finding
        self._hooks: List[Any] = []
        self._lr_snapshot: Optional[Tuple] = None

    # -- findings ------------------------------------------------------------------------------
    def add(self, kind: str, effect: str, file: str = "", line: int = 0, what: str = "", fix: str = "") -> None:
        key = (kind, file, line)
        if key not in self.found:
            self.found[key] = Finding(kind, effect, file, line, what, fix or FIXES[kind],
                                      self.step if self.step >= 0 else None)

    def add_at_frame(self, kind: str, effect: str, frame, what: str, fix: str = "") -> None:
        file, line = (os.path.abspath(frame.f_code.co_filename), frame.f_lineno) if frame is not None else ("", 0)
        self.add(kind, effect, file, line, what, fix)

    # -- the function mode -----------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.step < 0 or name in _METADATA:
            return func(*args, **kwargs)
        frame, tag = user_site(sys._getframe(1))
        if frame is None or tag == "ignore":
            return func(*args, **kwargs)
        self._inspect(name, args, kwargs, frame, tag)
        if name == "backward":
            self.in_backward = True  # syncs that CUDA reports from here come from autograd (and DDP's reducer)
            try:
                out = func(*args, **kwargs)
            finally:
                self.in_backward = False
        else:
            out = func(*args, **kwargs)
        if tag is None:
            file = os.path.abspath(frame.f_code.co_filename)
            self.traces[-1].append(_Call(name, file, frame.f_lineno, _shapes(out), _scalars(args, kwargs)))
            self._remember(out, args, file, frame.f_lineno)
        return out

    def _on_device(self, value) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device.type

    def _inspect(self, name: str, args, kwargs, frame, tag) -> None:
        first = args[0] if args else None
        kind = "grad_scaler" if tag == "scaler" else "host_sync"
        fix = FIXES["grad_scaler"] if tag == "scaler" else None
        if name in _VALUE_SYNCS and self._on_device(first):
            self.add_at_frame(kind, BLOCKS, frame, _SYNC_WHAT[name], fix or _SYNC_FIX.get(name, ""))
        elif name in _MASK_OPS and self._is_mask_op(name, args, kwargs):
            self.add_at_frame(kind, BLOCKS, frame, _SYNC_WHAT[name], fix or _SYNC_FIX["mask"])
            self.data_dependent_shapes = True  # later shapes follow the data: not compared between steps
        elif name in ("cpu", "to", "copy_", "cuda") and isinstance(first, torch.Tensor):
            self._inspect_copy(name, args, kwargs, frame, kind, fix)
        elif name in ("tensor", "as_tensor", "asarray") and args and not isinstance(first, torch.Tensor):
            target = _device_of(kwargs.get("device"))
            if target is not None and target.type == self.device.type:
                self.add_at_frame("host_to_device_copy", BLOCKS, frame,
                                  f"torch.{name}(<Python data>, device=...) copies from the host on every step")
        generator = kwargs.get(_RANDOM_WITH_GENERATOR)
        if isinstance(generator, torch.Generator) and generator.device.type == self.device.type \
                and not any(generator is g for g in self.default_generators):
            self.add_at_frame("unregistered_generator", BLOCKS, frame,
                              f"{name} draws from a torch.Generator of its own, which the graph does not know")

    def _is_mask_op(self, name: str, args, kwargs) -> bool:
        first = args[0] if args else None
        if name == "__getitem__":
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and self._on_device(p) for p in parts)
        if name == "where":
            return len(args) + len(kwargs) == 1 and self._on_device(first)
        if name == "repeat_interleave":
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None and self._on_device(first)
        return self._on_device(first)

    def _inspect_copy(self, name: str, args, kwargs, frame, kind: str, fix: Optional[str]) -> None:
        src = args[0]
        to_host = False
        if name == "cpu":
            to_host = self._on_device(src)
        elif name == "to":
            target = next((_device_of(a) for a in list(args[1:]) + [kwargs.get("device")]
                           if _device_of(a) is not None and not isinstance(a, torch.dtype)), None)
            literal_cpu = any(a == "cpu" for a in list(args[1:]) + [kwargs.get("device")] if isinstance(a, str))
            if target is not None and target.type == "cpu":
                # On the CPU a device tensor cannot be told from a host one: only a literal 'cpu' counts.
                to_host = (self.cuda and src.is_cuda) or (not self.cuda and literal_cpu)
            elif self.cuda and target is not None and target.type == "cuda" and not src.is_cuda:
                self._h2d(src, kwargs.get("non_blocking", len(args) > 2 and args[2] is True), frame, "Tensor.to")
        elif name == "cuda" and self.cuda and not src.is_cuda:
            self._h2d(src, kwargs.get("non_blocking", False), frame, "Tensor.cuda()")
        elif name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and self.cuda:
            dst, other = src, args[1]
            if dst.is_cuda and not other.is_cuda:
                self._h2d(other, kwargs.get("non_blocking", len(args) > 2 and args[2] is True), frame, "copy_")
            elif not dst.is_cuda and other.is_cuda:
                to_host = True
        if to_host:
            self.add_at_frame(kind, BLOCKS, frame, _SYNC_WHAT[name], fix or _SYNC_FIX["copy"])

    def _h2d(self, host: torch.Tensor, non_blocking: bool, frame, what: str) -> None:
        if host.is_pinned() and non_blocking:
            return  # a pinned, asynchronous copy can be captured (the graph re-reads the same host buffer)
        self.add_at_frame("host_to_device_copy", BLOCKS, frame,
                          f"{what} copies from pageable host memory inside the step")

    def _remember(self, out, args, file: str, line: int) -> None:
        if self.step < 1 or len(self.made) > 200_000:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and not any(o is a for a in args):
                try:
                    self.made.append((weakref.ref(o), self.step, file, line))
                except TypeError:
                    pass

    # -- per step --------------------------------------------------------------------------------
    def start(self) -> None:
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._before_optimizer_step))
        self._lr_snapshot = self._lr_state()

    def stop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def begin_step(self, index: int, inputs: Sequence[Any]) -> None:
        self.step = index
        self.traces.append([])
        self.lr_at_step.append(None)
        self.inputs.append([_describe(x) for x in inputs])

    def end_step(self) -> None:
        self.step = -1

    def _lr_state(self) -> Tuple:
        state = []
        for opt in self.optimizers:
            for group in opt.param_groups:
                lr = group.get("lr")
                state.append(("tensor", id(lr)) if isinstance(lr, torch.Tensor) else ("number", lr))
        return tuple(state)

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.step < 0 or self.lr_at_step[-1] is not None:
            return
        self.lr_at_step[-1] = self._lr_state()
        if self.step_call_site is None:
            frame, _ = user_site(sys._getframe(1))
            if frame is not None:
                self.step_call_site = (os.path.abspath(frame.f_code.co_filename), frame.f_lineno)

    # -- line tracing: who writes the learning rate ----------------------------------------------
    def tracer(self, frame, event, arg):
        """A ``sys.settrace`` function: user frames only, each line checked for a changed lr."""
        if event != "call" or classify_file(frame.f_code.co_filename)[0] != "user":
            return None
        last = [frame.f_lineno]

        def local(f, ev, _arg):
            if ev in ("line", "return"):
                now = self._lr_state()
                if now != self._lr_snapshot:
                    line = f.f_lineno if ev == "return" else last[0]
                    self.lr_set_lines.setdefault(now, (os.path.abspath(f.f_code.co_filename), line))
                    self._lr_snapshot = now
                last[0] = f.f_lineno
            return local

        return local

    # -- after the steps -------------------------------------------------------------------------
    def compare_steps(self) -> None:
        """Findings from differences between consecutive steps (from the second to the third on)."""
        for i in range(2, len(self.traces)):
            self.step = i
            if self.inputs[i] != self.inputs[i - 1]:
                self._input_change(i)
            elif not self.data_dependent_shapes:
                self._trace_change(self.traces[i - 1], self.traces[i], i)
        self._lr_changes()
        self.step = -1

    def _input_change(self, i: int) -> None:
        before, after = self.inputs[i - 1], self.inputs[i]
        changed = next(k for k in range(max(len(before), len(after)))
                       if k >= len(before) or k >= len(after) or before[k] != after[k])
        was = before[changed] if changed < len(before) else "nothing"
        now = after[changed] if changed < len(after) else "nothing"
        a, b = self.traces[i - 1], self.traces[i]
        site = next(((c.file, c.line) for c, d in zip(a, b) if c.shapes != d.shapes), None)
        site = site or next(((c.file, c.line) for c in b), ("", 0))
        what = f"input {changed} changed from {_show(was)} to {_show(now)} at step {i}"
        if was[0] == "tensor" and now[0] == "tensor":
            self.add("shape_change", BLOCKS, *site, what + "; a graph replays the shapes it was captured with")
        else:
            self.add("shape_change", BLOCKS, *site, what + "; a graph replays the Python values it was captured "
                     "with", "Pass values that change as tensors (GraphedStep copies tensors into its buffers).")

    def _trace_change(self, a: List[_Call], b: List[_Call], i: int) -> None:
        sites_a = {(c.file, c.line) for c in a}
        sites_b = {(c.file, c.line) for c in b}
        if [(c.name, c.file, c.line) for c in a] != [(c.name, c.file, c.line) for c in b]:
            only = [c for c in b if (c.file, c.line) not in sites_a] + [c for c in a if (c.file, c.line) not in sites_b]
            if not only:
                only = [d for c, d in zip(a, b) if (c.name, c.file, c.line) != (d.name, d.file, d.line)] or b[len(a):]
            first = only[0] if only else (b or a)[0]
            if (first.file, first.line) not in {(f.file, f.line) for f in self.found.values()}:
                self.add("control_flow", WRONG, first.file, first.line,
                         f"steps {i - 1} and {i} ran different torch calls from here: a Python-side branch or loop "
                         "that changes between steps (the graph replays the path taken at capture)")
            return
        for c, d in zip(a, b):
            if c.shapes != d.shapes:
                self.add("shape_change", WRONG, d.file, d.line,
                         f"{d.name} made shape {_show_shapes(c.shapes)} at step {i - 1} and {_show_shapes(d.shapes)} "
                         f"at step {i} with the same inputs: a shape decided by Python state",
                         "Keep shapes fixed: compute sizes from values that never change between steps.")
                return
        for c, d in zip(a, b):
            if c.scalars != d.scalars:
                changed = [(x, y) for x, y in zip(c.scalars, d.scalars) if x != y][:1]
                value = f" ({changed[0][0]!r} then {changed[0][1]!r})" if changed else ""
                self.add("python_scalar", WRONG, d.file, d.line,
                         f"a Python number passed to {d.name} here changes between steps{value}")
                return

    def _lr_changes(self) -> None:
        seen = [s for s in self.lr_at_step if s is not None]
        site = self.step_call_site or ("", 0)
        for before, after in zip(seen, seen[1:]):
            if before == after:
                continue
            where = self.lr_set_lines.get(after, site)
            replaced = any(x[0] == "tensor" and y[0] == "tensor" and x != y for x, y in zip(before, after))
            if replaced:
                what = "an optimizer's lr tensor is replaced by a new tensor between steps: the graph reads the old one"
            else:
                pair = next((x[1], y[1]) for x, y in zip(before, after) if x != y) if len(before) == len(after) \
                    else (None, None)
                what = (f"an optimizer's lr is a Python number that changes between steps ({pair[0]!r} then "
                        f"{pair[1]!r}): the graph keeps the value it had at capture")
            self.add("lr_frozen", WRONG, *where, what)
            return
        for opt in self.optimizers:
            if getattr(opt.step, "_wrapped_by_lr_sched", False) and any(
                    not isinstance(g.get("lr"), torch.Tensor) for g in opt.param_groups):
                self.add("lr_frozen", WRONG, *site,
                         "a torch.optim.lr_scheduler drives this optimizer's Python-number lr: the graph keeps the "
                         "value it had at capture")

    def kept_tensors(self) -> None:
        """memory_growth: tensors made at one place in two or more steps and still alive at the end."""
        gc.collect()
        last = len(self.traces) - 1
        steps_alive: Dict[Tuple[str, int], set] = {}
        for ref, step, file, line in self.made:
            if 1 <= step <= last - 1 and ref() is not None:
                steps_alive.setdefault((file, line), set()).add(step)
        self.made.clear()
        for (file, line), steps in steps_alive.items():
            if len(steps) >= 2:
                self.step = min(steps)
                self.add("memory_growth", WRONG, file, line,
                         f"a tensor made here in each of {len(steps)} steps is still alive: the step keeps one per "
                         "step (a replayed graph adds none, and would keep overwriting one)")
        self.step = -1


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


# ---- checks on objects, before any step ------------------------------------------------------

def model_findings(model: torch.nn.Module, checks: Checks) -> List[Any]:
    """DDP's settings and SyncBatchNorm; returns the hooks to remove after the steps.

    The place of a module's finding is the user line that calls it (a forward pre-hook looks).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    handles = []

    def at_call(kind: str, what: str):
        def hook(module, args):
            frame, _ = user_site(sys._getframe(1))
            checks.add_at_frame(kind, BLOCKS, frame, what)
        return hook

    if isinstance(model, DDP) and model.find_unused_parameters:
        checks.ddp_syncs_in_backward = True
        handles.append(model.register_forward_pre_hook(at_call(
            "ddp_find_unused_parameters",
            "DDP built with find_unused_parameters=True copies its used-parameter map between host and device")))
    if syncbn_syncs_while_capturing() and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        for module in model.modules():
            if isinstance(module, torch.nn.SyncBatchNorm):
                handles.append(module.register_forward_pre_hook(at_call(
                    "sync_batchnorm", "SyncBatchNorm synchronizes with the host in its forward on this torch")))
                break
    return handles


def optimizer_findings(optimizers: Sequence[torch.optim.Optimizer], checks: Checks,
                       problem_of) -> None:
    """Optimizers whose step a capture refuses or would freeze; GraphedStep and the trainer refuse them too."""
    for opt in optimizers:
        problem = problem_of(opt)
        if not problem:
            continue
        has_mode = any("capturable" in g for g in opt.param_groups)
        fix = FIXES["optimizer"] if has_mode else ("Use an optimizer class with a capturable or fused CUDA mode "
                                                   "(SGD, Adam, AdamW, RMSprop, ...).")
        file, line = checks.step_call_site or ("", 0)
        checks.add("optimizer", BLOCKS, file, line, problem.split(";")[0], fix)
