"""The device work of one training step and one evaluation step.

Written once for every mode: run eagerly, captured whole into a CUDA graph, or around
partially graphed / compiled models. Everything here is graph-safe (no host syncs);
results land in device accumulators that the loop reads at its log interval.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from trainer.recipe import PADDING_MASK, Batch, Recipe
from trainer.schedules import LRSchedule


def accumulate(metrics: torch.Tensor, per_sample: torch.Tensor, correct: torch.Tensor, mask: torch.Tensor) -> None:
    """Adds a batch's masked [loss sum, correct count, sample count] to ``metrics`` (on the device)."""
    mask = mask.reshape(-1, *([1] * (per_sample.dim() - 1))).expand_as(per_sample)
    losses = torch.where(mask, per_sample.double(), 0.0)
    metrics += torch.stack([losses.sum(), (correct & mask).sum().double(), mask.sum().double()])


def model_input(batch, memory_format: torch.memory_format) -> torch.Tensor:
    """The batch's input in the model's memory format (a device copy inside the step: shapes stay static)."""
    x = batch["x"]
    return x.contiguous(memory_format=memory_format) if x.dim() == 4 else x


def model_call(recipe: Recipe, memory_format: torch.memory_format) -> Callable[[torch.nn.Module, Batch], Any]:
    """How the step calls the model on a batch: ``model(batch["x"])``, or the recipe's own
    ``forward(model, batch)`` (several inputs); ``x`` in the model's memory format either way."""
    forward = recipe.forward
    if forward is None:
        return lambda model, batch: model(model_input(batch, memory_format))
    return lambda model, batch: forward(model, {**batch, "x": model_input(batch, memory_format)})


class _Recorded(Exception):
    """Stops the model's forward at its first call, once the arguments are recorded."""


def model_call_arguments(call: Callable[[torch.nn.Module, Batch], Any], model: torch.nn.Module,
                         batch: Batch) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The (args, kwargs) that ``call(model, batch)`` calls ``model`` with; the model itself
    does not run. Raises ValueError when ``call`` never calls ``model``."""
    seen = []

    def record(_module, args, kwargs):
        seen.append((args, kwargs))
        raise _Recorded

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            call(model, batch)
    except _Recorded:
        pass
    finally:
        handle.remove()
    if not seen:
        raise ValueError("the model was not called")
    return seen[0]


def autocast_factory(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        # No autocast weight cache: a cached cast made during capture would be stale on replay.
        return lambda: torch.autocast(device.type, dtype=dtype, cache_enabled=False)
    return contextlib.nullcontext


def takes_reduction(criterion: Callable) -> bool:
    """Whether a criterion takes torch's ``reduction`` keyword ("none" | "mean")."""
    try:
        return "reduction" in inspect.signature(criterion).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def mean_loss(criterion: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The micro-batch's mean loss: fused by the criterion where it can reduce, else the mean of its values."""
    if takes_reduction(criterion):
        return lambda output, target: criterion(output, target, reduction="mean")
    return lambda output, target: criterion(output, target).mean()


def per_sample_loss(criterion: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if takes_reduction(criterion):
        return lambda output, target: criterion(output, target, reduction="none")
    return criterion


class TrainStep:
    def __init__(self, recipe: Recipe, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 schedule: LRSchedule, loader, *, grad_accum: int, grad_clip: float,
                 autocast: Callable, device: torch.device,
                 memory_format: torch.memory_format = torch.contiguous_format,
                 wrap_output_fn: Callable[[Callable], Callable] = lambda fn: fn,
                 scaler: Optional["torch.amp.GradScaler"] = None):
        self.forward = model_call(recipe, memory_format)
        # fp16's dynamic loss scale. All of it runs on the device when the optimizer takes the scale
        # itself (fused: ``_step_supports_amp_scaling``), so it is captured with the step: scaling,
        # unscaling before clipping, skipping a step whose gradients overflowed, and the scale update.
        self.scaler = scaler
        self.recipe, self.model, self.optimizer, self.schedule, self.loader = recipe, model, optimizer, schedule, loader
        self.grad_accum, self.grad_clip, self.autocast = grad_accum, grad_clip, autocast
        # graph.compile_model compiles these with the model
        self.loss, self.correct = wrap_output_fn(mean_loss(recipe.criterion)), wrap_output_fn(recipe.correct)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Kept lean, since these kernels run every step: the sum of micro-batch mean losses
        # and a correct count per item position (one add, no reduction). Counts are static
        # (steps × items_per_step) and known on the host; a NaN/Inf loss shows up as a
        # non-finite sum.
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct_count: Optional[torch.Tensor] = None  # shaped like recipe.correct's output; made by step 1
        self.items_per_step = 0  # loss terms (samples or tokens) per optimizer step, on this rank
        self.step = torch.zeros((), dtype=torch.int64, device=device)  # optimizer steps taken
        self.advance_step = not schedule.is_constant  # only a schedule reads the counter: skip its kernel
        # The metrics run on their own stream, beside the backward pass; inside a CUDA graph
        # they are a parallel branch, off the step's critical path.
        self.metrics_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The last step's global gradient norm before clipping; only computed when clipping.
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device) if grad_clip > 0 else None

    def __call__(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for micro in range(self.grad_accum):
            batch = self.recipe.preprocess(self.loader.next_batch(), True)
            last = micro == self.grad_accum - 1
            # DDP all-reduces only on the last micro-batch.
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with self.autocast():
                    output = self.forward(self.model, batch)
                loss = self.loss(output, batch["y"])
                joined = self._count(loss, output, batch["y"])
                backward = loss / self.grad_accum if self.grad_accum > 1 else loss
                (self.scaler.scale(backward) if self.scaler is not None else backward).backward()
            joined()  # before output and labels can be freed and their memory reused
        if self.grad_clip > 0:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients; the step then skips re-scaling
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
            self.grad_norm.copy_(norm)
        self.schedule.apply(self.step, self.optimizer)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped on the device when a gradient is inf/NaN
            self.scaler.update()  # halves the scale after an overflow, doubles it after growth_interval good steps
        else:
            self.optimizer.step()
        if self.advance_step:
            self.step += 1

    def _count(self, loss: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
        """Adds a micro-batch to the metrics, on the metrics stream; returns the join to call after backward."""
        stream = self.metrics_stream
        if stream is None:
            self._add(loss, output, target)
            return lambda: None
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            self._add(loss, output, target)
        return lambda: main.wait_stream(stream)

    @torch.no_grad()
    def _add(self, loss: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        correct = self.correct(output, target)
        if self.correct_count is None:
            self.correct_count = torch.zeros(correct.shape, dtype=torch.int64, device=correct.device)
        self.correct_count += correct
        self.loss_sum += loss.detach()
        self.items_per_step = correct.numel() * self.grad_accum

    def totals(self) -> torch.Tensor:
        """[sum of micro-batch mean losses, correct count] since the last reset (float64, on the device)."""
        correct = self.correct_count.sum() if self.correct_count is not None else self.loss_sum.new_zeros(())
        return torch.stack([self.loss_sum, correct.double()])

    def reset_totals(self) -> None:
        self.loss_sum.zero_()
        if self.correct_count is not None:
            self.correct_count.zero_()


class EvalStep:
    def __init__(self, recipe: Recipe, model_fn: Callable[[], torch.nn.Module], loader, *,
                 autocast: Callable, device: torch.device,
                 memory_format: torch.memory_format = torch.contiguous_format):
        self.forward = model_call(recipe, memory_format)
        self.recipe, self.model_fn, self.loader, self.autocast = recipe, model_fn, loader, autocast
        self.loss = per_sample_loss(recipe.criterion)
        self.metrics = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples

    @torch.no_grad()
    def __call__(self) -> None:
        batch = self.recipe.preprocess(self.loader.next_batch(), False)
        with self.autocast():
            output = self.forward(self.model_fn(), batch)
        accumulate(self.metrics, self.loss(output, batch["y"]), self.recipe.correct(output, batch["y"]),
                   batch[PADDING_MASK])
