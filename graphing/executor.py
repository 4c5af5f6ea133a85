"""The eager executor, and the interface every mode implements.

An executor decides how one step runs. The loop hands it two callables per role
("train" or "eval"): ``stage``, host work that fills the step's static inputs, and
``fn``, the device work of the step itself. ``run(role, stage, fn)`` executes one step;
``phase(role)`` names what the next step will be (warmup, eager, capture, graph) so
that timings are filed honestly.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.runtime import Runtime


class Executor:
    mode = "eager"

    def __init__(self, cfg_graph, rt: Runtime):
        self.cfg, self.rt = cfg_graph, rt
        self.warmup_iters = cfg_graph.warmup_iters
        self.calls: Counter = Counter()
        self.info: Dict[str, object] = {"mode": self.mode}
        self.eval_model: torch.nn.Module = None

    def wrap_model(self, model: torch.nn.Module, sample_args: Tuple[torch.Tensor, ...],
                   autocast: Callable) -> torch.nn.Module:
        """The module the training step calls (DDP-wrapped under torchrun)."""
        self.eval_model = model
        return self._ddp(model)

    def _ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.rt.distributed:
            return model
        device_ids = [self.rt.device.index] if self.rt.device.type == "cuda" else None
        return DDP(model, device_ids=device_ids)

    def phase(self, role: str) -> str:
        return "warmup" if self.calls[role] < self.warmup_iters else "eager"

    def run(self, role: str, stage: Callable[[], None], fn: Callable[[], None]) -> None:
        self.calls[role] += 1
        stage()
        fn()

    def close(self) -> None:
        """Releases graphs and their memory; call before the process group is destroyed."""
