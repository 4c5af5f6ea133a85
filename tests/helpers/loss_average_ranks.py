"""A tiny fp64 language model whose micro-batches hold very different numbers of loss labels, and its
training step; run under torchrun, two gloo ranks of it take one step with Recipe(loss_average="labels"),
which tests/test_loss_average.py compares with the same micro-batches summed in one process.

    torchrun --nproc_per_node=2 tests/helpers/loss_average_ranks.py OUT_DIR

Writes OUT_DIR/rank<R>.pt: the step's gradient as this rank's DDP model applied it (SGD at lr 1: the weights
before the step minus after) and the step's metric totals.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from graphing import GraphOptions  # noqa: E402
from graphing.executor import Executor  # noqa: E402
from trainer.data import StepShape, micro_slice  # noqa: E402
from trainer.recipe import IGNORE_INDEX, PADDING_MASK, Batch, Datasets, Recipe, Split, top1_correct  # noqa: E402
from trainer.step.schedules import Constant  # noqa: E402
from trainer.step.steps import StepSettings, TrainStep, build_step_model  # noqa: E402

VOCAB, WIDTH, ROWS, CONTEXT = 11, 6, 4, 8
# Loss labels per micro-batch of each rank's step (of ROWS * CONTEXT = 32 positions): rank 0's are dense,
# rank 1's sparse, so a mean of per-micro-batch (or per-rank) means weighs rank 1's few tokens far more.
RANK_LABELS = {0: (30, 24), 1: (2, 5)}


def next_token_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Cross-entropy of each token, kept in the logits' dtype (fp64 here); -100 labels carry none."""
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction=reduction)
    return loss.view_as(target) if reduction == "none" else loss


def tiny_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB)).double()


def micro_batch(seed: int, labelled: int) -> Batch:
    """ROWS windows of random tokens, of whose labels only ``labelled`` (at random places) carry loss."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=g)
    y = torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=g)
    kept = torch.zeros(ROWS * CONTEXT, dtype=torch.bool)
    kept[torch.randperm(ROWS * CONTEXT, generator=g)[:labelled]] = True
    return {"x": x, "y": torch.where(kept.view_as(y), y, IGNORE_INDEX)}


def rank_batches(rank: int) -> List[Batch]:
    return [micro_batch(100 * rank + i, labelled) for i, labelled in enumerate(RANK_LABELS[rank])]


class Batches:
    """A loader over given micro-batches: ``next_batch`` hands them out in turn; ``tail_batch`` slices their
    rows joined, with the first ``real`` rows marked real (an epoch's padded last step)."""

    def __init__(self, batches: List[Batch], real: Optional[int] = None):
        self.batches, self.at = batches, 0
        self.joined = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        rows = len(self.joined["x"])
        self.mask = torch.arange(rows) < (rows if real is None else real)

    def next_batch(self) -> Batch:
        batch = self.batches[self.at % len(self.batches)]
        self.at += 1
        return dict(batch)

    def tail_batch(self, shape: StepShape, micro: int) -> Batch:
        rows = micro_slice(shape, micro)
        return {**{k: v[rows] for k, v in self.joined.items()}, PADDING_MASK: self.mask[rows]}


def tiny_recipe(loss_average: str = "labels", criterion=next_token_loss) -> Recipe:
    first = micro_batch(0, 1)
    split = Split(first["x"], first["y"])
    return Recipe(name="tiny_lm", model=tiny_lm(), data=Datasets(split, split, "t"),
                  preprocess=lambda batch, train: batch, criterion=criterion, correct=top1_correct,
                  loss_average=loss_average)


def sgd_step(recipe: Recipe, loader, grad_accum: int, world_size: int = 1, count_with_loss: bool = False,
             fused_loss: bool = False) -> TrainStep:
    """The training step as the Trainer assembles it (eager; in DDP when a process group is up), with SGD at
    lr 1, so that the weights it moves by are its gradient; ``count_with_loss``/``fused_loss`` as
    graph.compile_model asks (tests/test_step.py's step_model)."""
    executor = Executor(GraphOptions(mode="eager").resolved("cpu", world_size, False), torch.device("cpu"))
    settings = StepSettings(device=torch.device("cpu"), grad_accum=grad_accum, world_size=world_size)
    model = build_step_model(recipe, recipe.model, executor, settings, with_loss=fused_loss,
                             count_with_loss=count_with_loss)
    optimizer = torch.optim.SGD(recipe.model.parameters(), lr=torch.tensor(1.0, dtype=torch.float64))
    return TrainStep(recipe, model, optimizer, Constant(base_lr=1.0, total_steps=1), loader, settings)


def step_gradient(step: TrainStep, shape: Optional[StepShape] = None) -> List[torch.Tensor]:
    """The gradient the step applied to each parameter (SGD, lr 1: before minus after)."""
    before = [p.detach().clone() for p in step.recipe.model.parameters()]
    step(shape)
    return [b - p.detach() for b, p in zip(before, step.recipe.model.parameters())]


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    recipe = tiny_recipe("labels")
    step = sgd_step(recipe, Batches(rank_batches(rank)), grad_accum=len(RANK_LABELS[rank]),
                    world_size=dist.get_world_size())
    gradient = step_gradient(step)
    torch.save({"gradient": gradient, "totals": step.totals()}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
