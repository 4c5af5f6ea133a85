"""The torch calls a step makes from Python, seen through a ``TorchFunctionMode``.

Calls that read a device value on the host (``.item()``, ``print(tensor)``, a tensor in an ``if``,
a boolean mask, ``.cpu()``), copy a Python value or pageable host memory to the device
(``torch.tensor(0.5, device=...)``) or draw from a generator of the device other than the default
one are findings at once. Every other call from the user's code is handed to the step records
(step_diff.py), to be compared between steps, and its outputs to the memory watch (memory.py).
Each call is blamed on the line that attribution.py finds (and, inside an installed package,
on that package's line too).
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from graphing.doctor.attribution import Site, call_site
from graphing.doctor.findings import BLOCKS, FIXES, Findings, place_of
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
_CONSTRUCTORS = {"tensor", "as_tensor", "asarray"}
_MAX_MUTATED = 10_000  # device tensors written in place, at most, remembered for the replay comparison
# Metadata reads: no device work, nothing to check, not worth a frame walk.
_METADATA = {"__get__", "__set__", "dim", "size", "stride", "numel", "data_ptr", "is_contiguous", "element_size",
             "__len__", "storage_offset", "is_floating_point", "is_complex", "get_device", "nelement", "ndimension",
             "__hash__", "has_names", "is_pinned"}


class CallInterceptor(TorchFunctionMode):
    """Entered around each eager step; ``in_backward`` tells syncs that come from autograd.

    ``inspect_only``: what the doctor's trial capture uses (capture_attempt.py): the same checks,
    adding to ``findings`` (a list of their own there) the calls it sees, and nothing else.
    ``mutated``: the device tensors that the step's code wrote in place (weak references), the
    state a comparison of replays with eager steps restores besides the model and optimizer.
    """

    def __init__(self, device: torch.device, findings: Findings, records: Optional[StepRecords] = None,
                 memory: Optional[MemoryWatch] = None, inspect_only: bool = False):
        super().__init__()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.findings = findings
        self.records = records
        self.memory = memory
        self.inspect_only = inspect_only
        self.default_generators = [torch.default_generator]
        if self.cuda:
            self.default_generators += list(torch.cuda.default_generators)
        self.in_backward = False
        self.mutated: Dict[int, Any] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.findings.step < 0 or name in _METADATA:
            return func(*args, **kwargs)
        site = call_site(sys._getframe(1))
        if (site.user is None and site.library is None) or site.tag == "ignore":
            return func(*args, **kwargs)
        self._inspect(name, args, kwargs, site)
        if name == "backward":
            self.in_backward = True  # syncs that CUDA reports from here come from autograd (and DDP's reducer)
            try:
                out = func(*args, **kwargs)
            finally:
                self.in_backward = False
        else:
            out = func(*args, **kwargs)
        if name in _CONSTRUCTORS and args and not isinstance(args[0], torch.Tensor):
            self._inspect_constructor(name, kwargs, out, site)
        if self.inspect_only:
            return out
        self._remember_mutation(name, args, kwargs)
        if site.tag is None:
            file, line = place_of(site.user if site.user is not None else site.library)
            library = place_of(site.library) if site.user is not None else ("", 0)
            self.records.record_call(name, file, line, out, args, kwargs, library)
            self.memory.remember(out, args, file, line)
        return out

    def _remember_mutation(self, name: str, args, kwargs) -> None:
        targets = [kwargs.get("out")]
        if args and (name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))):
            targets.append(args[0])
        for t in targets:
            if not self._on_device(t):
                continue
            known = self.mutated.get(id(t))
            if known is not None and known() is t:
                continue
            if len(self.mutated) >= _MAX_MUTATED:  # most are a step's temporaries, gone by now
                self.mutated = {k: ref for k, ref in self.mutated.items() if ref() is not None}
            if len(self.mutated) < _MAX_MUTATED:
                self.mutated[id(t)] = weakref.ref(t)

    def mutated_tensors(self) -> List[torch.Tensor]:
        """The device tensors the steps wrote in place that are still alive."""
        return [t for t in (ref() for ref in self.mutated.values()) if t is not None]

    def _on_device(self, value) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device.type

    def _inspect(self, name: str, args, kwargs, site: Site) -> None:
        first = args[0] if args else None
        kind = "grad_scaler" if site.tag == "scaler" else "host_sync"
        fix = FIXES["grad_scaler"] if site.tag == "scaler" else None
        if name in _VALUE_SYNCS and self._on_device(first):
            self.findings.add_at_site(kind, BLOCKS, site, _SYNC_WHAT[name], fix or _SYNC_FIX.get(name, ""))
        elif name in _MASK_OPS and self._is_mask_op(name, args, kwargs):
            self.findings.add_at_site(kind, BLOCKS, site, _SYNC_WHAT[name], fix or _SYNC_FIX["mask"])
            if self.records is not None:
                self.records.data_dependent_shapes = True
        elif name in ("cpu", "to", "copy_", "cuda") and isinstance(first, torch.Tensor):
            self._inspect_copy(name, args, kwargs, site, kind, fix)
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and generator.device.type == self.device.type \
                and not any(generator is g for g in self.default_generators):
            self.findings.add_at_site("unregistered_generator", BLOCKS, site,
                                      f"{name} draws from a torch.Generator of its own, which the graph does not "
                                      "know")

    def _inspect_constructor(self, name: str, kwargs, out, site: Site) -> None:
        """``torch.tensor(<Python data>, device=...)``: a copy from the host, unless the data is empty
        (``torch.tensor([])`` copies nothing: a library's lazily made empty buffer)."""
        target = _device_of(kwargs.get("device"))
        if target is not None and target.type == self.device.type \
                and not (isinstance(out, torch.Tensor) and out.numel() == 0):
            self.findings.add_at_site("host_to_device_copy", BLOCKS, site,
                                      f"torch.{name}(<Python data>, device=...) copies from the host on every step")

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

    def _inspect_copy(self, name: str, args, kwargs, site: Site, kind: str, fix: Optional[str]) -> None:
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
                self._host_to_device(src, kwargs.get("non_blocking", len(args) > 2 and args[2] is True), site,
                                     "Tensor.to")
        elif name == "cuda" and self.cuda and not src.is_cuda:
            self._host_to_device(src, kwargs.get("non_blocking", False), site, "Tensor.cuda()")
        elif name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and self.cuda:
            dst, other = src, args[1]
            if dst.is_cuda and not other.is_cuda:
                self._host_to_device(other, kwargs.get("non_blocking", len(args) > 2 and args[2] is True), site,
                                     "copy_")
            elif not dst.is_cuda and other.is_cuda:
                to_host = True
        if to_host:
            self.findings.add_at_site(kind, BLOCKS, site, _SYNC_WHAT[name], fix or _SYNC_FIX["copy"])

    def _host_to_device(self, host: torch.Tensor, non_blocking: bool, site: Site, what: str) -> None:
        if (host.is_pinned() and non_blocking) or host.numel() == 0:
            return  # a pinned, asynchronous copy can be captured (the graph re-reads the same host buffer)
        self.findings.add_at_site("host_to_device_copy", BLOCKS, site,
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
