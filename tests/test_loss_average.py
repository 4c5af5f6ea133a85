"""Recipe(loss_average="labels"): a step's loss is its per-label losses summed over every micro-batch on every
rank, divided by the labels that carry loss in all of them (not a mean of per-micro-batch or per-rank means,
which weighs a token in a sparse micro-batch more); metrics and evaluation count those labels alone.
"micro_batch" (the default) keeps each micro-batch's mean, as before."""
from __future__ import annotations

import pytest
import torch

from helpers.launches import launch
from helpers.loss_average_ranks import (
    RANK_LABELS, Batches, micro_batch, next_token_loss, rank_batches, sgd_step, step_gradient, tiny_lm, tiny_recipe,
)
from recipes.gpt import next_token_criterion, next_token_loss_and_top1
from trainer.data import StepShape
from trainer.recipe import IGNORE_INDEX, PADDING_MASK
from trainer.run.errors import ConfigError
from trainer.step.steps import EvalStep, StepSettings

EXACT = dict(rtol=0.0, atol=1e-10)  # fp64 throughout: only summation order differs
DENSE, SPARSE = micro_batch(1, 30), micro_batch(2, 2)  # 30 and 2 loss labels of 32 positions


def gradient(loss_of, batches):
    """Autograd of ``loss_of(model)`` on a fresh copy of the tiny model: the reference."""
    model = tiny_lm()
    return torch.autograd.grad(loss_of(model, batches), list(model.parameters()))


def summed_over_labels(model, batches):
    total = sum(next_token_loss(model(b["x"]), b["y"], reduction="sum") for b in batches)
    return total / sum(int((b["y"] != IGNORE_INDEX).sum()) for b in batches)


def mean_of_means(model, batches):
    return sum(next_token_loss(model(b["x"]), b["y"], reduction="mean") for b in batches) / len(batches)


def assert_all_close(got, expected, **tolerance):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **(tolerance or EXACT))


@pytest.mark.fast
def test_a_step_of_a_dense_and_a_sparse_micro_batch_follows_its_summed_loss_over_its_labels():
    step = sgd_step(tiny_recipe("labels"), Batches([DENSE, SPARSE]), grad_accum=2)
    assert_all_close(step_gradient(step), gradient(summed_over_labels, [DENSE, SPARSE]))
    # what the default still computes, and what it would be wrong to: the sparse micro-batch's 2 tokens
    # weigh as much as the dense one's 30
    step = sgd_step(tiny_recipe("micro_batch"), Batches([DENSE, SPARSE]), grad_accum=2)
    assert_all_close(step_gradient(step), gradient(mean_of_means, [DENSE, SPARSE]))
    apart = [a - b for a, b in zip(gradient(mean_of_means, [DENSE, SPARSE]),
                                   gradient(summed_over_labels, [DENSE, SPARSE]))]
    assert max(float(d.abs().max()) for d in apart) > 1e-2


@pytest.mark.fast
def test_the_metrics_count_loss_labels_and_give_the_steps_loss_over_them():
    step = sgd_step(tiny_recipe("labels"), Batches([DENSE, SPARSE]), grad_accum=2)
    model = tiny_lm()
    with torch.no_grad():
        expected_loss = float(summed_over_labels(model, [DENSE, SPARSE]))
        expected_correct = sum(int((model(b["x"]).argmax(-1) == b["y"]).sum()) for b in (DENSE, SPARSE))
    step()
    loss_sum, correct, count = step.totals().tolist()
    assert count == 30 + 2  # not 2 x 32 positions
    assert loss_sum / count == pytest.approx(expected_loss, rel=1e-12)
    assert 0 < correct == expected_correct  # a -100 label is never counted correct


@pytest.mark.fast
def test_a_padded_tail_step_counts_the_labels_of_its_real_rows_only():
    """8 rows (4 + 4) of which 6 are real: the gradient and metrics of the real rows' labels alone."""
    batches = [DENSE, SPARSE]
    step = sgd_step(tiny_recipe("labels"), Batches(batches, real=6), grad_accum=2)
    real = [DENSE, {k: v[:2] for k, v in SPARSE.items()}]
    assert_all_close(step_gradient(step, StepShape((4, 4), tail=True, real=6)), gradient(summed_over_labels, real))
    loss_sum, _, count = step.totals().tolist()
    assert count == sum(int((b["y"] != IGNORE_INDEX).sum()) for b in real)
    with torch.no_grad():
        assert loss_sum / count == pytest.approx(float(summed_over_labels(tiny_lm(), real)), rel=1e-12)


@pytest.mark.fast
@pytest.mark.parametrize("count_with_loss,fused_loss", [(True, False), (True, True)],
                         ids=["fused-loss-and-top1", "model-and-loss-as-one"])
def test_the_fused_loss_and_top1_sums_as_the_criterion_does(count_with_loss, fused_loss):
    """graph.compile_model runs the criterion's fused loss and top-1 (recipes.gpt.next_token_loss_and_top1):
    asked for "sum" under loss_average="labels", it trains and counts as the criterion apart."""
    def run(**build):
        step = sgd_step(tiny_recipe("labels", next_token_criterion()), Batches([DENSE, SPARSE]), grad_accum=2,
                        **build)
        return step_gradient(step), step.totals()

    apart, fused = run(), run(count_with_loss=count_with_loss, fused_loss=fused_loss)
    assert_all_close(fused[0], apart[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fused[1], apart[1], rtol=1e-6, atol=0.0)
    assert_all_close(apart[0], gradient(summed_over_labels, [DENSE, SPARSE]), rtol=1e-5, atol=1e-6)  # fp32 loss

    logits, labels = torch.randn(2, 8, 11), SPARSE["y"][:2]
    for smoothing in (0.0, 0.1):
        loss, correct = next_token_loss_and_top1(smoothing)(logits, labels, reduction="sum")
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum",
                                                     label_smoothing=smoothing)
        torch.testing.assert_close(loss, expected)
        mean, same_correct = next_token_loss_and_top1(smoothing)(logits, labels)
        torch.testing.assert_close(mean, expected / (labels != IGNORE_INDEX).sum())
        assert torch.equal(correct, same_correct)


@pytest.mark.fast
def test_labels_with_a_criterion_that_cannot_sum_is_refused_when_the_step_is_built():
    def per_token_only(output, target):
        return next_token_loss(output, target)

    with pytest.raises(ConfigError, match="loss_average='labels'.*`reduction`"):
        sgd_step(tiny_recipe("labels", per_token_only), Batches([DENSE]), grad_accum=1)
    with pytest.raises(ConfigError, match="loss_average='tokens'"):
        sgd_step(tiny_recipe("tokens"), Batches([DENSE]), grad_accum=1)
    sgd_step(tiny_recipe("micro_batch", per_token_only), Batches([DENSE]), grad_accum=1)()  # the mean of its values


@pytest.mark.fast
def test_evaluation_counts_only_the_loss_labels_of_real_rows():
    batch = {**DENSE, PADDING_MASK: torch.tensor([True, True, True, False])}  # the last row pads the split
    model = tiny_lm()
    with torch.no_grad():
        logits = model(DENSE["x"][:3])
    y = DENSE["y"][:3]
    labelled = y != IGNORE_INDEX
    expected = {"labels": [float(next_token_loss(logits, y, reduction="sum")),
                           int(((logits.argmax(-1) == y) & labelled).sum()), int(labelled.sum())],
                "micro_batch": [float(next_token_loss(logits, y).sum()), int((logits.argmax(-1) == y).sum()), 3 * 8]}
    for loss_average, (loss_sum, correct, count) in expected.items():
        step = sgd_step(tiny_recipe(loss_average), Batches([batch]), grad_accum=1)
        evaluation = EvalStep(step.recipe, step.model, Batches([batch]), StepSettings(device=torch.device("cpu")))
        evaluation()
        got = evaluation.metrics.tolist()
        assert got[1:] == [correct, count] and got[0] == pytest.approx(loss_sum, rel=1e-12), loss_average
    assert expected["labels"][2] < 24


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_average")
    run = launch([str(out)], None, script="tests/helpers/loss_average_ranks.py", nproc=2, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]


def test_two_ranks_with_different_label_counts_take_the_gradient_of_one_process_over_all_their_labels(two_ranks):
    """Two gloo ranks in DDP, rank 0 holding 54 loss labels and rank 1 holding 7: each applies the gradient
    of the summed loss over all 61, as one process holding every micro-batch computes it."""
    everything = rank_batches(0) + rank_batches(1)
    expected = gradient(summed_over_labels, everything)
    for rank in two_ranks:
        assert_all_close(rank["gradient"], expected)
    apart = [a - b for a, b in zip(gradient(mean_of_means, everything), expected)]
    assert max(float(d.abs().max()) for d in apart) > 1e-2  # a mean of means would have missed
    model = tiny_lm()
    with torch.no_grad():
        for rank, result in enumerate(two_ranks):
            loss_sum, _, count = result["totals"].tolist()
            assert count == sum(RANK_LABELS[rank])  # each rank counts its own; the Trainer sums them
            assert loss_sum / count == pytest.approx(float(summed_over_labels(model, rank_batches(rank))), rel=1e-12)
