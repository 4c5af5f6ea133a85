"""Do a few replays of the trial capture equal eager steps? Both run from one state with the same
inputs: the state the step changes (parameters, buffers, optimizer state, the device tensors its
code wrote in place, the RNG) is saved first and written back in place (the graph reads those
addresses) before the replays and after them.

Equal means close, not bitwise: a library may take another path while capturing (transformers
builds an explicit attention mask where eager steps skip it), whose kernels round differently in
bf16. So outputs must agree within ``OUTPUT_RTOL`` of their size, and parameters within
``PARAMETER_RTOL`` of how far the eager steps moved them (all parameters as one vector): a frozen
or wrong step misses by far more than rounding does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch

OUTPUT_RTOL = 2e-2
PARAMETER_RTOL = 0.25


@dataclass
class ReplayComparison:
    replays: int
    equal: bool
    worst: str  # the largest difference, in words

    def describe(self) -> str:
        return (f"{self.replays} replays {'equal' if self.equal else 'differ from'} eager steps from the same "
                f"state ({self.worst})")


class StepState:
    """The state a step changes, saved as copies on its device and written back in place."""

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 mutated: Sequence[torch.Tensor], device: torch.device):
        self.device = device
        tensors: Dict[int, torch.Tensor] = {}
        for t in [*model.parameters(), *model.buffers(), *mutated]:
            tensors.setdefault(id(t), t)
        self.optimizers = list(optimizers)
        self.groups: List[List[Dict[str, Any]]] = []
        self.values: List[Dict[Any, Dict[str, Any]]] = []  # optimizer state entries that are not tensors
        for opt in self.optimizers:
            self.groups.append([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
            for g in opt.param_groups:
                for v in g.values():
                    if isinstance(v, torch.Tensor):
                        tensors.setdefault(id(v), v)
            values = {}
            for p, entry in opt.state.items():
                values[p] = {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}
                for v in entry.values():
                    if isinstance(v, torch.Tensor):
                        tensors.setdefault(id(v), v)
            self.values.append(values)
        self.tensors = list(tensors.values())
        with torch.no_grad():
            self.saved = [t.detach().clone() for t in self.tensors]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in zip(self.tensors, self.saved):
                t.copy_(saved)
        for opt, groups, values in zip(self.optimizers, self.groups, self.values):
            for g, saved in zip(opt.param_groups, groups):
                g.update({k: v for k, v in saved.items() if not isinstance(v, torch.Tensor)})
            for p, entry in values.items():
                opt.state[p].update(entry)
        self.restore_rng()

    def restore_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def tensors_of(out: Any) -> List[torch.Tensor]:
    """The tensors in a step's output (a tensor, tuple, list, dict or a library's output object)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors_of(o)]
    return []


def copies(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t.detach().float().clone() for t in tensors]


def compare(eager: Sequence[Sequence[torch.Tensor]], replayed: Sequence[Sequence[torch.Tensor]],
            eager_params: Sequence[torch.Tensor], replay_params: Sequence[torch.Tensor],
            start_params: Sequence[torch.Tensor]) -> ReplayComparison:
    """Outputs step by step, then parameters after the steps (float copies of each)."""
    for i, (a, b) in enumerate(zip(eager, replayed)):
        if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
            return ReplayComparison(len(replayed), False, f"step {i}'s outputs differ in number or shape")
    # (difference as a fraction of what is allowed, what it is in words)
    seen: List[Tuple[float, str]] = [(0.0, "no difference")]
    for i, (a, b) in enumerate(zip(eager, replayed)):
        for k, (x, y) in enumerate(zip(a, b)):
            relative = _norm(x - y) / max(_norm(x), 1e-12)
            seen.append((relative / OUTPUT_RTOL, f"output {k} of step {i}: relative difference {relative:.2g}"))
    # All parameters as one vector: a parameter that only noise moves (a bias whose gradient is zero in exact
    # arithmetic, which Adam scales up to full steps) differs as much as it moved, and weighs nothing here.
    differences = [_norm(x - y) for x, y in zip(eager_params, replay_params)]
    moved = math.sqrt(sum(_norm(x - s) ** 2 for x, s in zip(eager_params, start_params)))
    size = math.sqrt(sum(_norm(x) ** 2 for x in eager_params))
    relative = math.sqrt(sum(d ** 2 for d in differences)) / max(moved, 1e-6 * size, 1e-12)
    if differences:
        k = max(range(len(differences)), key=lambda i: differences[i])
        seen.append((relative / PARAMETER_RTOL, f"the parameters: {relative:.2g} of how far the eager steps moved "
                                                f"them (most in parameter {k})"))
    ratio, words = max(seen, key=lambda r: math.inf if math.isnan(r[0]) else r[0])
    return ReplayComparison(len(replayed), ratio <= 1 and len(eager) == len(replayed), f"largest: {words}")


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))
