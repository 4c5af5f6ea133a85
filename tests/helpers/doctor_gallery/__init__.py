"""A gallery of small training steps, each broken in one way the graph doctor must name.

Each module has ``build(device) -> Case``. The line that causes a problem carries a marker
comment ``# doctor: <kind>``: the tests read the expected kind and line from the source, so
moving code never breaks them. A module without markers is a step the doctor must call ready.
``EXPECT`` in each module says what really happens when the step runs through
``graphing.GraphedStep`` on CUDA (tests/test_doctor_gpu.py checks it): "fails", "differs"
(captures, then replays something other than eager does) or "matches".
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

CASES = [
    "sync_item", "sync_print", "sync_tensor_if", "sync_mask", "sync_cpu", "sync_linalg", "shape_change",
    "partial_last_batch",
    "host_to_device", "lr_float", "lr_between_calls", "optimizer_not_capturable", "adam_as_built", "grad_scaler",
    "grad_scaler_fused", "autocast_outer", "autocast_inside", "ddp_find_unused", "sync_batchnorm", "generator",
    "memory_growth", "control_flow", "python_scalar", "two_defects", "clean",
]
MARKER = re.compile(r"#\s*doctor:\s*([a-z_]+)")
VERDICT_OF = {"blocks": "blocked", "wrong": "captures-but-wrong"}


@dataclass
class Case:
    step: Callable[..., Any]  # step_fn(model, *inputs), as GraphedStep and diagnose take it
    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    inputs: Callable[[], Any]  # each call: the next step's inputs
    verdict: str  # what the doctor must say: ready, blocked, captures-but-wrong
    expect: str  # what GraphedStep really does on CUDA: fails, differs, matches
    needs_cuda: bool = False  # only CUDA's own checks can see it
    needs_process_group: bool = False
    ddp_kwargs: Optional[Dict[str, Any]] = None
    # The user's loop around the steps (an outer autocast, say): around(run) calls run() inside it.
    around: Callable[[Callable[[], Any]], Any] = field(default=lambda run: run())
    # What a step leaves behind besides the parameters, compared between eager and graphed runs.
    extra: Callable[[], List[float]] = field(default=lambda: [])
    max_graphs: int = 8  # GraphedStep's and the doctor's bound on input shapes


def load(name: str, device: torch.device) -> Case:
    return importlib.import_module(f"{__name__}.{name}").build(torch.device(device))


def marked(name: str) -> Dict[str, List[int]]:
    """{kind: [line, ...]} from the module's ``# doctor: <kind>`` comments."""
    path = Path(__file__).with_name(f"{name}.py")
    out: Dict[str, List[int]] = {}
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        match = MARKER.search(text)
        if match:
            out.setdefault(match.group(1), []).append(number)
    return out


def source(name: str) -> str:
    return str(Path(__file__).with_name(f"{name}.py").resolve())


def small_model(device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)


def batches(device: torch.device, batch_size: int = 8, count: int = 6, last: Optional[int] = None,
            seed: int = 1, sizes: Optional[Dict[int, int]] = None) -> Callable[[], Any]:
    """A loader of ``count`` fixed batches, cycled; ``last`` makes the final batch of each round partial;
    ``sizes`` gives other batches of the round other sizes ({position: rows})."""
    g = torch.Generator().manual_seed(seed)
    data = []
    sizes = dict(sizes or {})
    if last is not None:
        sizes[count - 1] = last
    for i in range(count):
        n = sizes.get(i, batch_size)
        x = torch.randn(n, 4, generator=g)
        data.append((x.to(device), (x.sum(1, keepdim=True) * 0.5).to(device)))
    position = [0]

    def next_batch():
        batch = data[position[0] % count]
        position[0] += 1
        return batch

    return next_batch


def sgd(model: nn.Module, device: torch.device, lr: float = 0.05) -> torch.optim.Optimizer:
    """SGD as a graphed user builds it: a device-tensor lr, fused on CUDA."""
    import graphing

    kwargs = graphing.graph_safe_optimizer_kwargs(torch.optim.SGD, device, {"momentum": 0.9})
    return torch.optim.SGD(model.parameters(), lr=torch.tensor(lr, device=device), momentum=0.9, **kwargs)


def fp16_scaled_step(optimizer: torch.optim.Optimizer, scaler: "torch.amp.GradScaler",
                     boost: Optional[torch.Tensor] = None) -> Callable[..., torch.Tensor]:
    """fp16's documented GradScaler usage: float16 autocast, scale, unscale before clipping, step,
    update. ``boost``: a device tensor the loss is multiplied by (a loop writes inf into it to
    make a step overflow)."""
    import torch.nn.functional as F

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.float16, cache_enabled=False):
            loss = F.mse_loss(model(x).float(), y)
        if boost is not None:
            loss = loss * boost
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    return step


def mse_step(optimizer: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    """The plain step of the cases whose defect lies outside it (in the optimizer, the model, the loop)."""
    import torch.nn.functional as F

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step
