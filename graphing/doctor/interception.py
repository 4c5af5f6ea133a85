"""The torch calls a step makes from Python, seen through a ``TorchFunctionMode``.

Calls that read a device value on the host (``.item()``, ``print(tensor)``, a tensor in an ``if``,
a boolean mask, ``.cpu()``), copy a Python value or pageable host memory to the device
(``torch.tensor(0.5, device=...)``) or draw from a generator of the device other than the default
one are findings at once. Every other call from the user's code is handed to the step records
(step_diff.py), to be compared between steps, and its outputs to the memory watch (memory.py).
Each call is blamed on the line that attribution.py finds.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from graphing.doctor.attribution import user_site
from graphing.doctor.findings import BLOCKS, FIXES, Findings
from graphing.doctor.memory import MemoryWatch
from graphing.doctor.step_diff import StepRecords

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
# Metadata reads: no device work, nothing to check, not worth a frame walk.
_METADATA = {"__get__", "__set__", "dim", "size", "stride", "numel", "data_ptr", "is_contiguous", "element_size",
             "__len__", "storage_offset", "is_floating_point", "is_complex", "get_device", "nelement", "ndimension",
             "__hash__", "has_names", "is_pinned"}


class CallInterceptor(TorchFunctionMode):
    """Entered around each eager step; ``in_backward`` tells syncs that come from autograd."""

    def __init__(self, device: torch.device, findings: Findings, records: StepRecords, memory: MemoryWatch):
        super().__init__()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.findings = findings
        self.records = records
        self.memory = memory
        self.default_generators = [torch.default_generator]
        if self.cuda:
            self.default_generators += list(torch.cuda.default_generators)
        self.in_backward = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.findings.step < 0 or name in _METADATA:
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
            self.records.record_call(name, file, frame.f_lineno, out, args, kwargs)
            self.memory.remember(out, args, file, frame.f_lineno)
        return out

    def _on_device(self, value) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device.type

    def _inspect(self, name: str, args, kwargs, frame, tag) -> None:
        first = args[0] if args else None
        kind = "grad_scaler" if tag == "scaler" else "host_sync"
        fix = FIXES["grad_scaler"] if tag == "scaler" else None
        if name in _VALUE_SYNCS and self._on_device(first):
            self.findings.add_at_frame(kind, BLOCKS, frame, _SYNC_WHAT[name], fix or _SYNC_FIX.get(name, ""))
        elif name in _MASK_OPS and self._is_mask_op(name, args, kwargs):
            self.findings.add_at_frame(kind, BLOCKS, frame, _SYNC_WHAT[name], fix or _SYNC_FIX["mask"])
            self.records.data_dependent_shapes = True
        elif name in ("cpu", "to", "copy_", "cuda") and isinstance(first, torch.Tensor):
            self._inspect_copy(name, args, kwargs, frame, kind, fix)
        elif name in ("tensor", "as_tensor", "asarray") and args and not isinstance(first, torch.Tensor):
            target = _device_of(kwargs.get("device"))
            if target is not None and target.type == self.device.type:
                self.findings.add_at_frame("host_to_device_copy", BLOCKS, frame,
                                           f"torch.{name}(<Python data>, device=...) copies from the host on every "
                                           "step")
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and generator.device.type == self.device.type \
                and not any(generator is g for g in self.default_generators):
            self.findings.add_at_frame("unregistered_generator", BLOCKS, frame,
                                       f"{name} draws from a torch.Generator of its own, which the graph does not "
                                       "know")

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
            targets: Sequence = list(args[1:]) + [kwargs.get("device")]
            target = next((_device_of(a) for a in targets
                           if _device_of(a) is not None and not isinstance(a, torch.dtype)), None)
            literal_cpu = any(a == "cpu" for a in targets if isinstance(a, str))
            if target is not None and target.type == "cpu":
                # On the CPU a device tensor cannot be told from a host one: only a literal 'cpu' counts.
                to_host = (self.cuda and src.is_cuda) or (not self.cuda and literal_cpu)
            elif self.cuda and target is not None and target.type == "cuda" and not src.is_cuda:
                self._host_to_device(src, kwargs.get("non_blocking", len(args) > 2 and args[2] is True), frame,
                                     "Tensor.to")
        elif name == "cuda" and self.cuda and not src.is_cuda:
            self._host_to_device(src, kwargs.get("non_blocking", False), frame, "Tensor.cuda()")
        elif name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and self.cuda:
            dst, other = src, args[1]
            if dst.is_cuda and not other.is_cuda:
                self._host_to_device(other, kwargs.get("non_blocking", len(args) > 2 and args[2] is True), frame,
                                     "copy_")
            elif not dst.is_cuda and other.is_cuda:
                to_host = True
        if to_host:
            self.findings.add_at_frame(kind, BLOCKS, frame, _SYNC_WHAT[name], fix or _SYNC_FIX["copy"])

    def _host_to_device(self, host: torch.Tensor, non_blocking: bool, frame, what: str) -> None:
        if host.is_pinned() and non_blocking:
            return  # a pinned, asynchronous copy can be captured (the graph re-reads the same host buffer)
        self.findings.add_at_frame("host_to_device_copy", BLOCKS, frame,
                                   f"{what} copies from pageable host memory inside the step")


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
