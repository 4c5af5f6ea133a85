"""memory_growth: what the step keeps from step to step. A replayed graph allocates nothing new,
so a step that keeps a tensor per step (a list of losses) would keep overwriting one instead.

Weak references find tensors made at one user line in two or more steps and still alive after
the steps; on CUDA, allocated device memory that grows in each of the last steps is named too.
"""
from __future__ import annotations

import gc
import inspect
import os
import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from graphing.doctor.findings import WRONG, Findings

_MAX_REMEMBERED = 200_000  # tensors; beyond this a step is not watched further (the host's memory)


class MemoryWatch:
    def __init__(self, findings: Findings, device: torch.device):
        self.findings = findings
        self.device = device
        self.made: List[Tuple[Any, int, str, int]] = []  # (weakref, step, file, line)
        self.allocated: List[int] = []  # device bytes after each step (CUDA)
        self._froze = False

    def start(self) -> None:
        """Before the steps: the objects that exist now are frozen out of the collection ``stop`` makes (a full one
        takes tenths of a second in a process with torch loaded; the steps' own objects are few). Not where the
        process froze objects itself: thawing ours would thaw those too."""
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()

    def stop(self) -> None:
        """After the steps, also when one raised: the cyclic garbage among the steps' objects collected, and what
        ``start`` froze thawed."""
        if self._froze:
            gc.collect()
            gc.unfreeze()
            self._froze = False

    def remember(self, out, args, file: str, line: int) -> None:
        """The tensors a user line made (not handed back one of its inputs), from the second step on."""
        step = self.findings.step
        if step < 1 or len(self.made) > _MAX_REMEMBERED:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        given = {id(t) for a in args for t in (a if isinstance(a, (tuple, list)) else (a,))}  # foreach ops' lists
        for o in outs:
            if isinstance(o, torch.Tensor) and id(o) not in given:
                try:
                    self.made.append((weakref.ref(o), step, file, line))
                except TypeError:
                    pass

    def after_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.allocated.append(torch.cuda.memory_allocated(self.device))

    def find_growth(self, last_step: int, step_fn: Callable[..., Any]) -> None:
        self._kept_tensors(last_step)
        if self.device.type == "cuda" and "memory_growth" not in self.findings.kinds() and _grows(self.allocated):
            self.findings.add("memory_growth", WRONG, *_definition(step_fn),
                              f"allocated device memory grew in each of the last steps (to "
                              f"{self.allocated[-1] / 2**20:.1f} MiB): the step keeps something per step")

    def _kept_tensors(self, last_step: int) -> None:
        """Tensors made at one place in two or more steps (not the last) and still alive now. Before naming one, a
        full collection: ``stop``'s left out garbage older than the steps, which may hold a step's tensors."""
        steps_alive = self._steps_alive(last_step)
        if any(len(steps) >= 2 for steps in steps_alive.values()):
            gc.collect()
            steps_alive = self._steps_alive(last_step)
        self.made.clear()
        for (file, line), steps in steps_alive.items():
            if len(steps) >= 2:
                self.findings.step = min(steps)
                self.findings.add("memory_growth", WRONG, file, line,
                                  f"a tensor made here in each of {len(steps)} steps is still alive: the step keeps "
                                  "one per step (a replayed graph adds none, and would keep overwriting one)")
        self.findings.step = -1

    def _steps_alive(self, last_step: int) -> Dict[Tuple[str, int], set]:
        alive: Dict[Tuple[str, int], set] = {}
        for ref, step, file, line in self.made:
            if 1 <= step <= last_step - 1 and ref() is not None:
                alive.setdefault((file, line), set()).add(step)
        return alive


def _grows(allocated: Sequence[int]) -> bool:
    tail = list(allocated[-4:])
    return len(tail) == 4 and all(b > a for a, b in zip(tail, tail[1:]))


def _definition(fn) -> Tuple[str, int]:
    try:
        return os.path.abspath(inspect.getsourcefile(fn)), fn.__code__.co_firstlineno
    except (TypeError, AttributeError):
        return "", 0
