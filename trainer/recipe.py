"""The Recipe contract: what a recipe hands to the trainer.

A recipe is any callable ``build(cfg, runtime) -> Recipe`` named by ``recipe._target_``
(a dotted path: ``recipes.mnist.build``, or ``my_package.my_module.build`` from your
own package on PYTHONPATH). It reads its own settings from ``cfg.recipe`` and checks
the choices it owns (its data sources, its model options) once, raising
``trainer.run.errors.ConfigError`` with the setting named.

A recipe knows its model, data and loss; it never needs to know whether its step is
graphed. What it provides runs inside the step, so it must be graph-safe: device-side
work on static shapes, no ``.item()`` or other host syncs (see graphing/__init__.py).

A model with one input gets ``batch["x"]``. A model with several (an attention mask beside
the tokens, a second image) gets them from its dataset's further fields: an item is then a
dict ``{"x": ..., "y": ..., "attention_mask": ...}`` (or a ``Split`` with ``extra_inputs``),
and ``Recipe.forward`` says how a batch reaches the model, e.g.
``lambda model, batch: model(batch["x"], batch["attention_mask"])``.

The criterion and ``correct`` read what ``Recipe.forward`` returns (without one, what the model
returns). A model whose output is an object (a Hugging Face ``CausalLMOutputWithPast``: ``logits``,
perhaps a ``loss``) gets a ``forward`` that returns the tensor the criterion reads, e.g.
``lambda model, batch: model(batch["x"]).logits``: the step keeps nothing else of the output.

Activation checkpointing (``train.activation_checkpointing=true``) is the recipe's to apply,
since only it knows its model's blocks: ``build`` reads ``cfg.train.activation_checkpointing``,
its model runs each block through ``trainer.step.activation_checkpointing.checkpointed`` when it is
true, and it returns ``Recipe(..., activation_checkpointing=True)`` to say so. A recipe that
leaves ``activation_checkpointing`` False (the default) is refused with the setting on, with one
ConfigError naming it, rather than trained without it.

Label smoothing (``recipe.label_smoothing``) is the recipe's too, since only it knows its loss:
its criterion applies the setting, and ``Recipe(..., label_smoothing=cfg.recipe.label_smoothing)``
says so. A run whose setting differs from what its Recipe says it applies (0 by default) is
refused with one ConfigError naming the setting, rather than trained without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union, get_args

import torch

# "x", "y", the dataset's further inputs by name, and for evaluation "mask" (False on padding).
Batch = Dict[str, torch.Tensor]
PADDING_MASK = "mask"  # the trainer's own field: a dataset's fields must be named otherwise
IGNORE_INDEX = -100  # a label that carries no loss (padding, a prompt token): F.cross_entropy's default ignore_index
LossAverage = Literal["micro_batch", "labels"]  # Recipe.loss_average
LOSS_AVERAGES = get_args(LossAverage)


@dataclass
class Split(torch.utils.data.Dataset):
    """One split held in memory as tensors whose first dim is the sample: inputs ``x`` (any
    dtype), labels ``y``, and for a model with several inputs the others by name."""

    x: torch.Tensor
    y: torch.Tensor
    extra_inputs: Dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> Union[Tuple[torch.Tensor, torch.Tensor], Dict[str, torch.Tensor]]:
        if not self.extra_inputs:
            return self.x[i], self.y[i]
        return {name: values[i] for name, values in self.fields().items()}

    def fields(self) -> Dict[str, torch.Tensor]:
        """Every tensor of the split by its batch name: "x", "y" and the extra inputs."""
        return {"x": self.x, "y": self.y, **self.extra_inputs}

    def to_split(self) -> "Split":
        return self


# A split is a ``Split`` or any map-style ``torch.utils.data.Dataset`` (a torchvision
# dataset, a folder of images, a memory-mapped token file, your own) whose item ``i`` is
# ``(x, y)``, or for a model with several inputs a dict ``{"x": ..., "y": ..., <name>: ...}``
# (any names but "mask", the trainer's padding mask). ``x`` and every further input: a tensor
# (or numpy array) of the same shape and dtype for every sample; ``y`` an int or a tensor.
# Item 0 is checked when the recipe is built. Both loaders carry every field: the host
# loader reads the dataset through DataLoader workers; the device loader needs it in device
# memory and asks ``dataset.to_split()`` for its tensors when the dataset has that method
# (a fast path), otherwise it reads every item once.
SplitLike = Union[Split, torch.utils.data.Dataset]


@dataclass
class Datasets:
    train: SplitLike
    test: SplitLike
    source: str  # what was actually used: "mnist", "synthetic", "folder", "tokens", ...
    # What the data is, for results.json and W&B's summary ("data/padding_fraction" of packed documents: the share
    # of the training rows' tokens that are padding, which perf/real_tokens_per_s leaves out; "data/documents", ...)
    stats: Dict[str, float] = field(default_factory=dict)


@dataclass
class Recipe:
    name: str
    model: torch.nn.Module  # built on the CPU, identically on every rank; the trainer moves it
    data: Datasets
    # Device-side batch transform (normalize, augment); runs inside the step.
    preprocess: Callable[[Batch, bool], Batch]
    # The loss from model outputs and labels, one value per sample (or token). Written like
    # torch's functional losses (``F.cross_entropy`` itself fits): when it takes a ``reduction``
    # keyword, training asks for "mean" ("sum" under loss_average="labels") and evaluation for "none"
    # (the fused mean saves kernels in every step); without one, training takes the mean of what it returns.
    criterion: Callable[..., torch.Tensor]
    # Which predictions are right (bool, shaped like the per-sample loss): the accuracy metrics.
    # Training runs it beside the backward pass, off the step's critical path. With ``top1_correct``, a
    # criterion may carry both in one function as its ``with_top1`` attribute (``fused_with_top1``), which the
    # step runs where it compiles the loss with the accuracy: work both need is done once.
    correct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    units_per_sample: int = 1  # tokens per sample for language models
    unit: str = "samples"
    flops_per_unit: float = 0.0  # training FLOPs per sample (or token), for MFU; 0: unknown
    # How a (preprocessed) batch reaches the model, and its output the criterion: ``forward(model, batch)``
    # returns what ``criterion`` and ``correct`` read, e.g. ``model(batch["x"], batch["attention_mask"])``,
    # or ``model(batch["x"]).logits`` for a model that returns an object; None: ``model(batch["x"])``.
    # It runs inside the step (device work only); ``batch["x"]`` is already in the run's memory format. Under
    # graph.mode=partial it must call the model once, with tensors as positional arguments
    # (what torch.cuda.make_graphed_callables replays).
    forward: Optional[Callable[[torch.nn.Module, Batch], torch.Tensor]] = None
    # Whether the model checkpoints its blocks (trainer/step/activation_checkpointing.py): a recipe that
    # supports train.activation_checkpointing passes the setting's value; False refuses the setting.
    activation_checkpointing: bool = False
    # The label smoothing its criterion applies: a recipe that supports recipe.label_smoothing passes
    # the setting's value; a setting other than this value is refused.
    label_smoothing: float = 0.0
    # What the step's loss averages over. "micro_batch": each micro-batch's mean loss, averaged over the step's
    # micro-batches and ranks: right when every micro-batch holds as many loss terms (whole windows, samples).
    # "labels": the per-label losses summed over every micro-batch on every rank, divided by the number of
    # labels that carry loss (not IGNORE_INDEX) in all of them, so that a token weighs the same wherever it lies
    # (packed documents, conversations whose prompts carry no loss); the criterion must then take torch's
    # ``reduction`` keyword (the step asks for "sum"), and evaluation counts those labels alone too.
    loss_average: LossAverage = "micro_batch"
    # The model's repeated blocks (transformer layers, residual stages), in order: train.parallel=fsdp2
    # shards each on its own (trainer/parallel/sharding.py). A library model's own list serves as it is
    # (``blocks_named(model, model._no_split_modules)``). Empty: the model is sharded as one unit.
    blocks: Sequence[torch.nn.Module] = ()
    # Draws every parameter and buffer of the model in place: what train.fsdp.init=meta calls after the
    # model, built on the meta device (``with torch.device(rt.init_device)``), is sharded and allocated.
    # None: the recipe builds on the host only (train.fsdp.init=meta is refused).
    init_weights: Optional[Callable[[torch.nn.Module], None]] = None
    # Writes the trained model into a new directory in its library's own format (hf_causal_lm: a save_pretrained
    # directory), at the end of a run with checkpoint.export=DIR: ``export(model, directory)``, called on every
    # rank with the model as trained (sharded under fsdp2: a collective); ``directory`` exists, empty, and is
    # renamed to DIR once the call returns on every rank. None: checkpoint.export is refused.
    export: Optional[Callable[[torch.nn.Module, Path], None]] = None


def blocks_named(model: torch.nn.Module, class_names) -> List[torch.nn.Module]:
    """The modules of ``model`` whose class is named in ``class_names`` (a Hugging Face model's
    ``_no_split_modules``: ``LlamaDecoderLayer``, ``GPT2Block``, ...), in order: ``Recipe.blocks``."""
    names = set(class_names or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def fused_with_top1(criterion: Callable[..., torch.Tensor], with_top1: Callable[..., Tuple[torch.Tensor, torch.Tensor]],
                    top1: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None) -> Callable[..., torch.Tensor]:
    """``criterion``, carrying ``with_top1(output, target, reduction="mean") -> (criterion's mean, or its sum with
    ``reduction="sum"``; top1_correct)``: the two in one function, equal to them apart, which the training step
    runs where it compiles the loss with the accuracy (graph.compile_model) and the recipe's ``correct`` is
    ``top1_correct`` (recipes.gpt.next_token_loss_and_top1 reads the top-1's row maxima from the loss's own
    softmax). It travels with this criterion object: a recipe whose criterion or correctness is replaced
    (``dataclasses.replace``) computes the two apart again. ``top1``: the correctness ``with_top1`` counts, where the
    output is not the logits ``top1_correct`` reads (recipes/chunked_head.py: hidden states); the recipe's
    ``correct`` must be that function for the two to be fused."""
    criterion.with_top1 = with_top1
    criterion.top1 = top1 or top1_correct
    return criterion


def measure_with_top1(recipe: "Recipe") -> Optional[Callable[..., Tuple[torch.Tensor, torch.Tensor]]]:
    """The recipe's criterion and correctness in one function (``fused_with_top1``), or None where the two are
    not the criterion's own pair: another correctness than the one it counts, or a criterion without one."""
    fused = getattr(recipe.criterion, "with_top1", None)
    return fused if fused is not None and recipe.correct is recipe.criterion.top1 else None


def top1_correct(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``Recipe.correct`` for classifiers and language models: the label is what ``argmax`` picks, the first of
    the classes (or tokens) that score highest, as torchmetrics and transformers count it; a label tied with an
    earlier maximum counts as wrong (constant logits score the label 0 alone), a label out of range (a padding
    -100) as wrong.

    Compiled (graph.compile_model), it is ``label_scores_highest``: the same answer from plain maxima, which
    Inductor reads in the loss's own pass over the logits, where an argmax's index bookkeeping made that pass
    1.7x as long (gpt2_small on an H200). Eager, it is the argmax itself: the masked maximum would cost a
    temporary the size of the logits there."""
    if torch.compiler.is_compiling():
        return label_scores_highest(output, target, output.amax(dim=-1))
    return output.argmax(dim=-1) == target  # a target outside [0, classes) is no index: never equal


def label_scores_highest(output: torch.Tensor, target: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """``top1_correct`` with the rows' maxima ``best`` (shaped like ``target``) already at hand: a fused form
    (``fused_with_top1``) passes the maximum its loss computed, so both forms judge a prediction alike. The
    label is argmax's when it scores ``best`` and every class before it scores less: the maximum over those
    earlier classes is a masked maximum, which Inductor computes in the pass that finds ``best``."""
    label = target.clamp(0, output.shape[-1] - 1).long()
    scored = output.gather(-1, label.unsqueeze(-1)).squeeze(-1)
    earlier = torch.arange(output.shape[-1], device=output.device) < label.unsqueeze(-1)
    best_before = torch.where(earlier, output, float("-inf")).amax(dim=-1)
    # label 0 has nothing before it (a row of -inf throughout, argmax's 0, included)
    first_of_best = (scored == best) & ((best_before < best) | (label == 0))
    return first_of_best & (label == target)
