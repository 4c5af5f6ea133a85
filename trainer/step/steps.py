"""The device work of one training step and one evaluation step: the step order, on one screen.

One path for every mode: what the step computes (the model and its loss, compiled together or
not) is chosen once, when the Trainer builds the run (``build_step_model``), and the step runs the
same code whether it runs eagerly, is captured whole into a CUDA graph, or calls partially graphed / compiled
models. Everything here is graph-safe (no host syncs); results land in device accumulators
that the loop reads at its log interval.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from graphing import Executor, no_sync_except_last
from trainer.data import StepShape
from trainer.run.errors import ConfigError
from trainer.recipe import IGNORE_INDEX, LOSS_AVERAGES, PADDING_MASK, Batch, Recipe, measure_with_top1
from trainer.step.schedules import LRSchedule
from trainer.step.seq_len import truncate
from trainer.parallel.sharding import full_norm


def per_term(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A mask of real samples (one per row) spread over ``like``'s loss terms (a sequence's tokens)."""
    return mask.reshape(-1, *([1] * (like.dim() - 1))).expand_as(like)


def accumulate(metrics: torch.Tensor, per_sample: torch.Tensor, correct: torch.Tensor, mask: torch.Tensor) -> None:
    """Adds a batch's [loss sum, correct count, term count] over the terms ``mask`` keeps (shaped like
    ``per_sample``) to ``metrics`` (on the device)."""
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


def loss_and_correct(loss: Callable[[Any, torch.Tensor], torch.Tensor],
                     correct: Optional[Callable[[Any, torch.Tensor], torch.Tensor]]) -> Callable[..., Tuple[Any, Any]]:
    """One function of (output, target) giving (the loss, the per-item correctness or None). Compiled as
    one, the correctness (a top-1 over a language model's logits) is read in the loss's own kernels instead
    of a pass of its own over the whole output, and the output need not be held for it until backward ends."""
    if correct is None:
        return lambda output, target: (loss(output, target), None)
    return lambda output, target: (loss(output, target), correct(output, target))


class ModelAndLoss(torch.nn.Module):
    """The model and its loss as one callable: what the training step calls, in every mode.

    ``forward(batch, output)`` returns (the model's output or None with ``output=False``, the loss (the
    micro-batch's mean, or its sum under loss_average="labels"), the per-item correctness or None): ``measure``
    (``loss_and_correct``) gives the last two. Under ``graph.compile_model`` the executor wraps it whole, so that
    torch.compile sees one function and the output, never one of its results, is the compiler's to free once
    backward no longer needs it (a language model's logits); otherwise it holds the executor's wrapped model.
    The loss is computed outside autocast."""

    def __init__(self, model: torch.nn.Module, call: Callable[[torch.nn.Module, Batch], Any],
                 measure: Callable[[Any, torch.Tensor], Tuple[torch.Tensor, Optional[torch.Tensor]]],
                 device_type: str):
        super().__init__()
        self.model = model
        self.call, self.measure, self.device_type = call, measure, device_type

    def forward(self, batch: Batch, output: bool = True) -> Tuple[Any, torch.Tensor, Optional[torch.Tensor]]:
        out = self.call(self.model, batch)
        with torch.autocast(self.device_type, enabled=False):
            loss, correct = self.measure(out, batch["y"])
        return (out if output else None), loss, correct


@dataclass(frozen=True)
class StepModel:
    """What the steps compute, chosen once when the run is built: ``train(batch, output)`` returns (the model's
    output, or None when ``output`` is False; the micro-batch's loss (``step_loss``); its per-item correctness when
    counted with the loss, else None); ``evaluate(batch)`` the output; ``correct(output, target)`` the correctness that
    the metrics stream computes from the output (None: counted with the loss, or recipe.accuracy=false).
    ``module`` is what DDP wraps (``no_sync``) and what the optimizer's parameters belong to."""
    module: torch.nn.Module
    train: Callable[..., Tuple[Optional[Any], torch.Tensor, Optional[torch.Tensor]]]
    evaluate: Callable[[Batch], Any]
    correct: Optional[Callable[[Any, torch.Tensor], torch.Tensor]]
    accuracy: bool = True  # recipe.accuracy: whether correctness is counted at all


def build_step_model(recipe: Recipe, model: torch.nn.Module, executor: Executor, settings: "StepSettings", *,
                     with_loss: bool, memory_format: torch.memory_format = torch.contiguous_format,
                     sample_inputs: Optional[Callable[[], tuple]] = None, accuracy: bool = True,
                     count_with_loss: bool = False) -> StepModel:
    """The model wrapped by ``executor`` (DDP, graphs, compile) and the step's view of it.

    ``with_loss`` (graph.compile_model, unsharded): the executor wraps the model and its loss as one
    ModelAndLoss, compiled as one function; otherwise it wraps the model and the loss is applied to its
    output (``executor.wrap_output_fn``, compiled by itself under graph.compile_model).
    ``count_with_loss`` (graph.compile_model): the training step's correctness is computed in the loss's
    compiled function, fused with it (in one function with the loss where the criterion carries one:
    trainer.recipe.fused_with_top1); otherwise the metrics stream computes it from the output, beside
    backward (uncompiled, a kernel of its own either way, and off the step's critical path there)."""
    check_loss_average(recipe)
    call = model_call(recipe, memory_format)
    with_correct = recipe.correct if accuracy and count_with_loss else None
    fused = fused_step_loss(recipe) if with_correct is not None else None  # the criterion's own pair, fused
    measure = fused if fused is not None else loss_and_correct(step_loss(recipe), with_correct)
    device_type, autocast = settings.device.type, settings.autocast
    if with_loss:
        module = executor.wrap_model(ModelAndLoss(model, call, measure, device_type), sample_inputs, autocast)
        train = module
        eval_model = executor.eval_model

        def evaluate(batch):
            return eval_model(batch)[0]
    else:
        module = executor.wrap_model(model, sample_inputs, autocast)
        train = ModelAndLoss(module, call, executor.wrap_output_fn(measure), device_type)
        eval_model = executor.eval_model

        def evaluate(batch):
            return call(eval_model, batch)
    correct = executor.wrap_output_fn(recipe.correct) if accuracy and with_correct is None else None
    return StepModel(module, train, evaluate, correct, accuracy)


@dataclass(frozen=True)
class StepSettings:
    """How the steps run, from the plan: micro-batches per step, clipping, precision, ranks."""
    device: torch.device
    grad_accum: int = 1
    grad_clip: float = 0.0  # > 0: clip the global gradient norm (and record it)
    autocast: Callable[[], ContextManager] = contextlib.nullcontext
    world_size: int = 1
    # Device work run first and last inside every training and evaluation step, captured with it
    # (Parallelism.step_hooks): the float8 weight scales and casts of FSDP2's float8 all-gather from the weights as
    # they are now, then dropped. (The loop's host-side hook after a step is trainer/run/hooks.py's after_step.)
    first_in_step: Optional[Callable[[], None]] = None
    last_in_step: Optional[Callable[[], None]] = None


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
    """Whether a criterion takes torch's ``reduction`` keyword ("none" | "mean" | "sum")."""
    try:
        return "reduction" in inspect.signature(criterion).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def mean_loss(criterion: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The micro-batch's mean loss: fused by the criterion where it can reduce, else the mean of its values."""
    if takes_reduction(criterion):
        return lambda output, target: criterion(output, target, reduction="mean")
    return lambda output, target: criterion(output, target).mean()


def summed_loss(criterion: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The micro-batch's loss summed over its labels, by the criterion itself (which leaves out IGNORE_INDEX)."""
    return lambda output, target: criterion(output, target, reduction="sum")


def check_loss_average(recipe: Recipe) -> None:
    """Refuses a Recipe.loss_average the step cannot keep, once, when the step is built."""
    if recipe.loss_average not in LOSS_AVERAGES:
        raise ConfigError(f"the recipe {recipe.name!r} returns Recipe(loss_average={recipe.loss_average!r}), which is "
                          f"not one of {', '.join(LOSS_AVERAGES)}: return Recipe(loss_average='micro_batch') "
                          "(each micro-batch's mean) or 'labels' (the step's summed loss over its loss labels)")
    if recipe.loss_average == "labels" and not takes_reduction(recipe.criterion):
        raise ConfigError(f"the recipe {recipe.name!r} returns Recipe(loss_average='labels'), which sums its "
                          "criterion's per-label losses, but its criterion takes no `reduction` keyword: give the "
                          "criterion torch's `reduction` ('none' | 'mean' | 'sum', as F.cross_entropy has), or "
                          "return Recipe(loss_average='micro_batch')")


def step_loss(recipe: Recipe) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The micro-batch's loss as the training step takes it: its mean, or under loss_average="labels" its sum
    (the step divides by the labels counted over all its micro-batches and ranks)."""
    return summed_loss(recipe.criterion) if recipe.loss_average == "labels" else mean_loss(recipe.criterion)


def fused_step_loss(recipe: Recipe) -> Optional[Callable[[Any, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]]:
    """The criterion's fused loss and top-1 (``measure_with_top1``) reduced as ``step_loss`` reduces, or None
    (computed apart): a fused function that cannot sum is not asked to under loss_average="labels"."""
    fused = measure_with_top1(recipe)
    if fused is None or recipe.loss_average != "labels":
        return fused
    if not takes_reduction(fused):
        return None
    return lambda output, target: fused(output, target, reduction="sum")


def loss_labels(target: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which of ``target``'s labels carry loss (not IGNORE_INDEX); with ``mask``, of the real rows only."""
    labels = target != IGNORE_INDEX
    return labels if mask is None else labels & per_term(mask, target)


def per_sample_loss(criterion: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if takes_reduction(criterion):
        return lambda output, target: criterion(output, target, reduction="none")
    return criterion


class TrainStep:
    """One optimizer step: micro-batches (DDP all-reduces on the last), clipping, the device-side
    schedule, the optimizer, the step counter; the metrics counted on their own stream."""

    def __init__(self, recipe: Recipe, model: StepModel, optimizer: torch.optim.Optimizer, schedule: LRSchedule,
                 loader, settings: StepSettings, scaler: Optional["torch.amp.GradScaler"] = None):
        self.recipe, self.model, self.optimizer, self.schedule, self.loader = recipe, model, optimizer, schedule, loader
        self.settings = settings
        # fp16's dynamic loss scale. All of it runs on the device when the optimizer takes the scale
        # itself (fused: ``_step_supports_amp_scaling``), so it is captured with the step: scaling,
        # unscaling before clipping, skipping a step whose gradients overflowed, and the scale update.
        self.scaler = scaler
        self.correct = model.correct
        self.per_sample_loss = per_sample_loss(recipe.criterion)  # a tail step's: masked, summed
        self.by_labels = recipe.loss_average == "labels"  # the step's loss: summed, over its loss labels
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        device = settings.device
        # Kept lean, since these kernels run every step, off the critical path (metrics
        # stream): the sum of losses, the loss terms counted (samples or tokens) and a
        # correct count per item position, one per shape of recipe.correct's output (one
        # add, no reduction). Each shape's count is made by its first, eager, step: outside
        # any graph's memory pool. A NaN/Inf loss shows up as a non-finite sum.
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.item_count = torch.zeros((), dtype=torch.float64, device=device)
        self.correct_counts: Dict[torch.Size, torch.Tensor] = {}
        self.step = torch.zeros((), dtype=torch.int64, device=device)  # optimizer steps taken
        self.advance_step = not schedule.is_constant  # only a schedule reads the counter: skip its kernel
        # The metrics run on their own stream, beside the backward pass; inside a CUDA graph
        # they are a parallel branch, off the step's critical path.
        self.metrics_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The last step's global gradient norm before clipping; only computed when clipping.
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device) if settings.grad_clip > 0 else None

    def __call__(self, shape: Optional[StepShape] = None) -> None:
        """One optimizer step over ``shape``'s micro-batches (None: a full step of grad_accum)."""
        grad_accum, grad_clip = self.settings.grad_accum, self.settings.grad_clip
        tail = shape is not None and shape.tail
        # The output is kept for a tail's masked loss, or for the metrics stream when it computes the correctness
        want_output = tail or self.correct is not None
        if self.settings.first_in_step is not None:
            self.settings.first_in_step()
        self.optimizer.zero_grad(set_to_none=True)  # nothing left over is summed into this step's gradients
        micro_batches = range(len(shape.rows) if shape is not None else grad_accum)
        if self.by_labels:  # every micro-batch first: the step's loss labels are counted before its first loss
            batches = [self._batch(shape, micro) for micro in micro_batches]
            labels = [loss_labels(batch["y"], batch[PADDING_MASK] if tail else None) for batch in batches]
            counts = [micro_labels.sum() for micro_labels in labels]
            per_label = self._per_label_scale(counts)
        for micro in no_sync_except_last(self.model.module, micro_batches):  # DDP all-reduces on the last only
            batch = batches[micro] if self.by_labels else self._batch(shape, micro)
            with self.settings.autocast():
                output, loss, correct = self.model.train(batch, output=want_output)  # the loss outside autocast
            if self.by_labels:
                loss, joined = self._labels_loss(output, loss, batch, labels[micro], counts[micro], per_label,
                                                 tail, correct)
            elif tail:
                loss, joined = self._masked_loss(output, batch, shape, correct)
            else:
                joined = self._count(loss, output, batch["y"], correct=correct)
                loss = loss / grad_accum if grad_accum > 1 else loss
            del output  # what the metrics read, _Join holds; the rest is backward's to free
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            joined()  # before output and labels can be freed and their memory reused
        if grad_clip > 0:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients; the step then skips re-scaling
            norm = torch.nn.utils.clip_grad_norm_(self.params, grad_clip, foreach=True)
            self.grad_norm.copy_(full_norm(norm))  # over FSDP2's sharded gradients a replicated DTensor
        self.schedule.apply(self.step, self.optimizer)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped on the device when a gradient is inf/NaN
            self.scaler.update()  # halves the scale after an overflow, doubles it after growth_interval good steps
        else:
            self.optimizer.step()
        # No gradient lives between steps: their memory is free for evaluation, and when the step is captured
        # the eager warm-up's gradients are no longer held beside the graph's own (FSDP2 at 9.9B: 18 GiB).
        self.optimizer.zero_grad(set_to_none=True)
        if self.settings.last_in_step is not None:
            self.settings.last_in_step()
        if self.advance_step:
            self.step += 1

    def _batch(self, shape: Optional[StepShape], micro: int) -> Batch:
        """Micro-batch ``micro`` of the step, preprocessed (and cut to the step's sequence length)."""
        tail = shape is not None and shape.tail
        batch = self.recipe.preprocess(self.loader.tail_batch(shape, micro) if tail else self.loader.next_batch(), True)
        if tail and PADDING_MASK not in batch:
            raise ConfigError(f"the recipe's preprocess dropped the batch's {PADDING_MASK!r} field, which marks the "
                              "real samples of an epoch's last partial step: return {**batch, ...} from preprocess, "
                              "or set recipe.data.drop_last=true")
        if shape is not None and shape.seq_len is not None:
            batch = truncate(batch, shape.seq_len)  # a static slice: each length its own graph
        return batch

    def _per_label_scale(self, counts: List[torch.Tensor]) -> torch.Tensor:
        """world_size / the step's loss labels on every rank (at least 1), on the device: summed by an all-reduce,
        which a CUDA graph captures with the step (no host sync). DDP and FSDP2 divide the summed gradients by
        world_size, so each rank's summed losses times this give the gradient of the step's sum over its count."""
        total = torch.stack(counts).sum()
        if self.settings.world_size > 1:
            dist.all_reduce(total)  # SUM
        return self.settings.world_size / total.clamp(min=1).double()  # float64: exact for any loss dtype

    def _labels_loss(self, output: Optional[torch.Tensor], loss: torch.Tensor, batch: Batch, labels: torch.Tensor,
                     count: torch.Tensor, per_label: torch.Tensor, tail: bool, correct: Optional[torch.Tensor]
                     ) -> Tuple[torch.Tensor, Callable[[], None]]:
        """A micro-batch's loss for backward under loss_average="labels": its summed loss (a tail's over the loss
        labels of its real rows) times ``per_label``; the metrics add the sum and ``count``, its loss labels."""
        if tail:
            loss = torch.where(labels, self.per_sample_loss(output, batch["y"]), 0.0).sum()
        joined = self._count(loss, output, batch["y"], mask=batch[PADDING_MASK] if tail else None, correct=correct,
                             labels=count)
        return loss * per_label, joined

    def _masked_loss(self, output: torch.Tensor, batch: Batch, shape: StepShape, correct: Optional[torch.Tensor]
                     ) -> Tuple[torch.Tensor, Callable[[], None]]:
        """A tail micro-batch's loss for backward: the sum over its real samples, scaled so that
        the step's gradient (summed over micro-batches, averaged over ranks by DDP) is the mean
        over the tail's real samples on all ranks, as a full step's is over its samples."""
        per_sample = self.per_sample_loss(output, batch["y"])
        summed = torch.where(per_term(batch[PADDING_MASK], per_sample), per_sample, 0.0).sum()
        terms_per_sample = per_sample[0].numel()  # 1, or the tokens of a sequence
        joined = self._count(summed, output, batch["y"], mask=batch[PADDING_MASK], correct=correct)
        return summed * (self.settings.world_size / (shape.real * terms_per_sample)), joined

    def _count(self, loss: torch.Tensor, output: Optional[torch.Tensor], target: torch.Tensor,
               mask: Optional[torch.Tensor] = None, correct: Optional[torch.Tensor] = None,
               labels: Optional[torch.Tensor] = None) -> Callable[[], None]:
        """Adds a micro-batch to the metrics, on the metrics stream; returns the join to call after backward.
        ``loss``: the micro-batch's mean loss, or with ``mask`` the sum over its real samples, or with ``labels``
        (loss_average="labels": how many labels carry loss) the sum over those labels; ``correct``: the
        per-item correctness when the loss's function gave it (else the metrics stream computes it from
        ``output``, or counts none: recipe.accuracy=false)."""
        stream = self.metrics_stream
        if stream is None:
            self._add(loss, output, target, mask, correct, labels)
            return lambda: None
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            self._add(loss, output, target, mask, correct, labels)
        read = (output, target) if self.correct is not None else ()  # the output only when read here
        return _Join(main, stream, (loss, mask, correct, labels, *read))

    @torch.no_grad()
    def _add(self, loss: torch.Tensor, output: Optional[torch.Tensor], target: torch.Tensor,
             mask: Optional[torch.Tensor] = None, correct: Optional[torch.Tensor] = None,
             labels: Optional[torch.Tensor] = None) -> None:
        if correct is None and self.correct is not None:
            correct = self.correct(output, target)
        terms = correct if correct is not None else target  # one per loss term: a sample, or a token
        if labels is not None:  # a sum over ``labels`` loss labels; a label of IGNORE_INDEX is never correct
            self.loss_sum += loss.detach()
            self.item_count += labels
            if mask is not None and correct is not None:
                correct = correct & per_term(mask, correct)
        elif mask is None:
            self.loss_sum.add_(loss.detach(), alpha=terms.numel())  # a mean over the micro-batch's terms
            self.item_count += terms.numel()
        else:
            mask = per_term(mask, terms)
            self.loss_sum += loss.detach()
            self.item_count += mask.sum()
            correct = correct & mask if correct is not None else None
        if correct is None:
            return
        count = self.correct_counts.get(correct.shape)
        if count is None:
            count = self.correct_counts[correct.shape] = torch.zeros(correct.shape, dtype=torch.int64,
                                                                     device=correct.device)
        count += correct

    def totals(self) -> torch.Tensor:
        """[loss sum, correct count, loss terms] since the last reset (float64, on the device)."""
        correct = sum((c.sum() for c in self.correct_counts.values()), self.loss_sum.new_zeros((), dtype=torch.int64))
        return torch.stack([self.loss_sum, correct.double(), self.item_count])

    def reset_totals(self) -> None:
        self.loss_sum.zero_()
        self.item_count.zero_()
        for count in self.correct_counts.values():
            count.zero_()


class _Join:
    """Makes the main stream wait for the metrics stream. Until then it holds the tensors the
    metrics stream reads: freed earlier, the allocator could hand their memory to the main
    stream's next kernels (backward) while the metrics kernels still read it, which inside a
    captured graph means reading another kernel's data on every replay."""

    def __init__(self, main: "torch.cuda.Stream", metrics: "torch.cuda.Stream", reads: Tuple[Any, ...]):
        self.main, self.metrics, self.reads = main, metrics, reads

    def __call__(self) -> None:
        self.main.wait_stream(self.metrics)
        self.reads = ()


class EvalStep:
    """One evaluation batch: per-sample losses and correctness, masked to the real samples (under
    loss_average="labels" to their labels that carry loss), summed on the device."""

    def __init__(self, recipe: Recipe, model: StepModel, loader, settings: StepSettings):
        self.recipe, self.model, self.loader, self.settings = recipe, model, loader, settings
        self.loss = per_sample_loss(recipe.criterion)
        self.by_labels = recipe.loss_average == "labels"
        self.metrics = torch.zeros(3, dtype=torch.float64, device=settings.device)  # loss sum, correct, terms

    @torch.no_grad()
    def __call__(self) -> None:
        if self.settings.first_in_step is not None:
            self.settings.first_in_step()
        batch = self.recipe.preprocess(self.loader.next_batch(), False)
        with self.settings.autocast():
            output = self.model.evaluate(batch)
        per_sample = self.loss(output, batch["y"])
        correct = self.recipe.correct(output, batch["y"]) if self.model.accuracy else \
            torch.zeros(per_sample.shape, dtype=torch.bool, device=per_sample.device)
        real = batch[PADDING_MASK]
        counted = loss_labels(batch["y"], real) if self.by_labels else per_term(real, per_sample)
        accumulate(self.metrics, per_sample, correct, counted)
        if self.settings.last_in_step is not None:
            self.settings.last_in_step()


def positional_model_inputs(recipe: Recipe, memory_format: torch.memory_format, model: torch.nn.Module, batch,
                            recipe_target: str) -> tuple:
    """The tensors the step passes the model for ``batch``, for executors that trace the model
    ahead of time (graph.mode=partial: torch.cuda.make_graphed_callables replays positional tensors)."""
    try:
        args, kwargs = model_call_arguments(model_call(recipe, memory_format), model, batch)
    except ValueError:
        args, kwargs = None, {}
    if args is not None and not kwargs and all(torch.is_tensor(a) for a in args):
        return args
    how = ("never calls the model" if args is None
           else f"calls the model with keyword arguments ({', '.join(kwargs)})" if kwargs
           else "passes the model arguments that are not tensors")
    raise ConfigError(f"graph.mode=partial graphs the model with torch.cuda.make_graphed_callables, which replays "
                      f"tensors passed positionally, but the Recipe.forward of recipe._target_="
                      f"{recipe_target} {how}: pass the model tensors positionally in Recipe.forward, "
                      "or set graph=full (or graph=eager)")
