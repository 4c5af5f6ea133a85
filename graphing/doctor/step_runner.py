"""Running the user's step as GraphedStep does: its inputs made outside the step (like a loader)
and copied into static device buffers, the step itself on the side stream (CUDA)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar, Union

import torch

from graphing.capture import run_on_stream

Inputs = Union[Sequence[Any], Callable[[], Any]]
T = TypeVar("T")


def on_side_stream(fn: Callable[[], T], side: Optional["torch.cuda.Stream"]) -> T:
    """``fn()`` on the side stream, or where it is when there is none (the CPU)."""
    return fn() if side is None else run_on_stream(fn, side)


class StepRunner:
    def __init__(self, step_fn: Callable[..., Any], model: torch.nn.Module, inputs: Inputs, device: torch.device,
                 side: Optional["torch.cuda.Stream"]):
        self.step_fn = step_fn
        self.model = model
        self.device = device
        self.side = side
        self._make = _maker(inputs)
        self._buffers: Optional[List[Any]] = None

    def next_inputs(self) -> Tuple[Any, ...]:
        out = self._make()
        if out is None:
            return ()
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def stage(self, args: Sequence[Any]) -> List[Any]:
        """Copies tensor inputs into the static device buffers (made from the first inputs); what the step gets."""
        if self._buffers is None:
            self._buffers = [torch.empty_like(x, device=self.device) if isinstance(x, torch.Tensor) else x
                             for x in args]
        staged = []
        for k, x in enumerate(args):
            buffer = self._buffers[k] if k < len(self._buffers) else None
            if isinstance(x, torch.Tensor) and isinstance(buffer, torch.Tensor) and buffer.shape == x.shape \
                    and buffer.dtype == x.dtype:
                buffer.copy_(x, non_blocking=True)
                staged.append(buffer)
            else:  # a changed shape cannot go through the buffers: the doctor reports it, the step still runs
                staged.append(x.to(self.device) if isinstance(x, torch.Tensor) else x)
        return staged

    def call(self, staged: Sequence[Any]) -> Any:
        """The step on the current stream (a capture's); what it returned."""
        return self.step_fn(self.model, *staged)

    def run(self, staged: Sequence[Any]) -> Any:
        return on_side_stream(lambda: self.call(staged), self.side)

    def run_next(self) -> None:
        """One more step with the next inputs, unchecked."""
        self.run(self.stage(self.next_inputs()))


def _maker(inputs: Inputs) -> Callable[[], Any]:
    if hasattr(inputs, "__next__"):
        return lambda: next(inputs)
    if callable(inputs):
        return inputs
    return lambda: inputs
