"""The training step's own bookkeeping, on the CPU: how it asks the criterion for the loss,
what it counts, and when it advances its device step counter."""
from __future__ import annotations

import dataclasses
import pytest
import torch
import torch.nn.functional as F

from trainer.data import StepShape, micro_slice
from trainer.recipe import PADDING_MASK, Datasets, Recipe, Split, top1_correct
from trainer.step.schedules import Constant, Cosine
from graphing import GraphOptions
from graphing.executor import Executor
from trainer.step.steps import (EvalStep, StepSettings, TrainStep, build_step_model, mean_loss, per_sample_loss,
                                takes_reduction)

CPU = StepSettings(device=torch.device("cpu"))


def step_model(recipe, with_loss=False, accuracy=True, count_with_loss=False):
    """The step's view of ``recipe.model`` as assembly builds it, around an eager executor;
    ``with_loss``: the model and its loss as one ModelAndLoss, as graph.compile_model builds it;
    ``count_with_loss``: the correctness computed by the loss's function, as graph.compile_model asks."""
    executor = Executor(GraphOptions(mode="eager").resolved("cpu", 1, False), torch.device("cpu"))
    return build_step_model(recipe, recipe.model, executor, CPU, with_loss=with_loss, accuracy=accuracy,
                            count_with_loss=count_with_loss)

pytestmark = pytest.mark.fast


class FixedBatches:
    """A loader that hands out the same batch every time (the step only calls next_batch)."""

    def __init__(self, x, y, real=None):
        self.batch = {"x": x, "y": y}
        self.mask = torch.arange(len(x)) < (len(x) if real is None else real)

    def next_batch(self):
        return dict(self.batch)

    def tail_batch(self, shape, micro):
        rows = micro_slice(shape, micro)
        return {"x": self.batch["x"][rows], "y": self.batch["y"][rows], PADDING_MASK: self.mask[rows]}


def make_step(criterion, schedule, grad_accum=1, rows=8, real=None, fused_loss=False, accuracy=True,
              count_with_loss=False):
    """A step over a linear model; ``fused_loss``: the model and its loss wrapped as one
    ModelAndLoss, as graph.compile_model builds it; ``count_with_loss``: see step_model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4)[:rows], torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])[:rows]
    recipe = Recipe(name="t", model=model, data=Datasets(Split(x, y), Split(x, y), "t"),
                    preprocess=lambda batch, train: batch, criterion=criterion, correct=top1_correct)
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    step = TrainStep(recipe, step_model(recipe, fused_loss, accuracy, count_with_loss), optimizer, schedule,
                     FixedBatches(x, y, real), StepSettings(device=torch.device("cpu"), grad_accum=grad_accum))
    return step, model, x, y


def test_a_criterion_with_torchs_reduction_keyword_is_asked_for_the_mean():
    calls = []

    def criterion(output, target, reduction="none"):
        calls.append(reduction)
        return F.cross_entropy(output, target, reduction=reduction)

    assert takes_reduction(criterion) and takes_reduction(F.cross_entropy)
    out, target = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    assert mean_loss(criterion)(out, target).shape == () and calls == ["mean"]
    assert per_sample_loss(criterion)(out, target).shape == (5,) and calls == ["mean", "none"]


def test_a_per_sample_criterion_without_reduction_is_averaged():
    def criterion(output, target):
        return F.cross_entropy(output, target, reduction="none")

    assert not takes_reduction(criterion)
    out, target = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    assert mean_loss(criterion)(out, target) == pytest.approx(F.cross_entropy(out, target).item())
    assert per_sample_loss(criterion) is criterion


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_step_sums_micro_batch_losses_and_counts_correct_items(grad_accum):
    step, model, x, y = make_step(F.cross_entropy, Constant(base_lr=0.1, total_steps=10), grad_accum)
    expected_loss, expected_correct = 0.0, 0
    for _ in range(3):
        with torch.no_grad():
            out = model(x)
        expected_loss += grad_accum * F.cross_entropy(out, y, reduction="sum").item()
        expected_correct += grad_accum * int((out.argmax(-1) == y).sum())
        step()
    loss_sum, correct, items = step.totals().tolist()
    assert loss_sum == pytest.approx(expected_loss, rel=1e-6) and correct == expected_correct
    assert items == 3 * 8 * grad_accum
    step.reset_totals()
    assert step.totals().tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("rows", [(8,), (4, 4), (6, 2)])
def test_a_padded_tail_step_trains_and_counts_its_real_samples_only(rows):
    """5 real samples padded to 8 rows (in 1 or 2 micro-batches): the same update and metrics
    as a step over those 5 samples alone."""
    real = 5
    tail, model, x, y = make_step(F.cross_entropy, Constant(base_lr=0.1, total_steps=10), real=real)
    alone, alone_model, _, _ = make_step(F.cross_entropy, Constant(base_lr=0.1, total_steps=10), rows=real)
    with torch.no_grad():
        out = model(x[:real])
    tail(StepShape(rows, tail=True, real=real))
    alone()
    for p, q in zip(model.parameters(), alone_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    loss_sum, correct, items = tail.totals().tolist()
    assert items == real and correct == int((out.argmax(-1) == y[:real]).sum())
    assert loss_sum == pytest.approx(F.cross_entropy(out, y[:real], reduction="sum").item(), rel=1e-6)


def test_the_step_counter_advances_only_for_a_schedule_that_reads_it():
    constant, _, _, _ = make_step(F.cross_entropy, Constant(base_lr=0.1, total_steps=10))
    cosine, _, _, _ = make_step(F.cross_entropy, Cosine(base_lr=0.1, total_steps=10, warmup_steps=2))
    for _ in range(3):
        constant()
        cosine()
    assert int(constant.step) == 0 and int(cosine.step) == 3
    lr_after_3 = Cosine(base_lr=0.1, total_steps=10, warmup_steps=2).value(torch.tensor(2)).item()
    assert cosine.optimizer.param_groups[0]["lr"].item() == pytest.approx(lr_after_3)


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, keep):
        return self.linear(torch.where(keep, x, 0.0))


def test_a_recipes_forward_gives_the_model_a_second_input_in_training_and_evaluation():
    torch.manual_seed(0)
    model = TwoInputs()
    x, y, keep = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), torch.rand(8, 4) > 0.5
    batch = {"x": x, "y": y, "keep": keep}
    loader = FixedBatches(x, y)
    loader.batch = batch
    recipe = Recipe(name="t", model=model, data=Datasets(Split(x, y), Split(x, y), "t"),
                    preprocess=lambda batch, train: batch, criterion=F.cross_entropy, correct=top1_correct,
                    forward=lambda model, batch: model(batch["x"], batch["keep"]))
    with torch.no_grad():
        expected = F.cross_entropy(model(x, keep), y).item()
        without = F.cross_entropy(model(x, torch.ones_like(keep)), y).item()
    assert expected != pytest.approx(without)  # the second input changes the output
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.0))
    steps_view = step_model(recipe)
    step = TrainStep(recipe, steps_view, optimizer, Constant(base_lr=0.0, total_steps=1), loader, CPU)
    step()
    loss_sum, _, items = step.totals().tolist()
    assert loss_sum / items == pytest.approx(expected, rel=1e-6)

    loader.batch = {**batch, "mask": torch.ones(8, dtype=torch.bool)}  # evaluation's padding mask: all real
    evaluation = EvalStep(recipe, steps_view, loader, CPU)
    evaluation()
    assert evaluation.metrics[0].item() / 8 == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("count_with_loss", [False, True], ids=["counted-apart", "counted-with-loss"])
@pytest.mark.parametrize("grad_accum,real,accuracy", [(1, None, True), (2, None, False), (1, 5, True), (1, 5, False)])
def test_the_model_compiled_with_its_loss_trains_and_counts_as_the_model_and_loss_apart(grad_accum, real, accuracy,
                                                                                        count_with_loss):
    """graph.compile_model hands the step a ModelAndLoss (the model and its mean loss as one
    module) and has the loss's function compute the correctness: full steps, a padded tail step,
    accumulation and evaluation come out bit for bit as with the model and the loss called apart
    and the correctness computed from the output on the metrics stream."""
    def run(fused, counted_with_loss):
        step, model, x, y = make_step(F.cross_entropy, Constant(base_lr=0.1, total_steps=10), grad_accum,
                                      real=real, fused_loss=fused, accuracy=accuracy,
                                      count_with_loss=counted_with_loss)
        for _ in range(3):
            step(StepShape((8,), tail=True, real=real) if real is not None else None)
        evaluation = EvalStep(step.recipe, step.model, step.loader, CPU)
        step.loader.batch = {**step.loader.batch, PADDING_MASK: torch.ones(8, dtype=torch.bool)}
        evaluation()
        return [p.detach().clone() for p in model.parameters()], step.totals(), evaluation.metrics.clone()

    apart = run(False, False)
    for fused in (False, True):
        other = run(fused, count_with_loss)
        for a, b in zip(apart[0], other[0]):
            assert torch.equal(a, b)
        assert torch.equal(apart[1], other[1]) and torch.equal(apart[2], other[2])
    assert apart[1][2].item() == 3 * (real or 8 * grad_accum)  # the items counted: real samples only
    if accuracy:
        assert 0 < apart[1][1].item() <= apart[1][2].item()  # some items counted correct, no more than counted
    else:
        assert apart[1][1].item() == 0
    assert not torch.equal(apart[0][0], make_step(F.cross_entropy, Constant(base_lr=0.1, total_steps=10))[1].weight)


def test_correctness_counted_with_the_loss_leaves_the_output_unheld():
    """Counted with the loss, a full step asks the model for the loss and the correctness alone: the output
    (a language model's logits) is not kept for the metrics stream until backward ends."""
    step, *_ = make_step(F.cross_entropy, Constant(base_lr=0.1, total_steps=10), fused_loss=True,
                         count_with_loss=True)
    asked = []
    train = step.model.train
    step.model = dataclasses.replace(step.model, train=lambda batch, output: asked.append(output) or train(batch, output))
    step()
    assert asked == [False] and step.model.correct is None and step.totals()[1].item() > 0
