"""recipe.accuracy=false: the metrics are the loss alone (no top-1 over a language model's
vocabulary in every step), and the training itself is unchanged."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.fast
TINY = ["recipe=gpt_tiny", "experiment=debug", "logger=none", "recipe.model.n_layer=1", "recipe.model.d_model=32",
        "recipe.model.n_head=2", "recipe.model.context=32", "recipe.data.train_size=256", "recipe.data.test_size=40",
        "recipe.data.batch_size=8", "recipe.data.eval_batch_size=16", "train.max_steps=12", "train.log_every=4"]


def test_without_accuracy_the_same_training_logs_the_loss_alone(train_here, out):
    runs = {flag: train_here([*TINY, f"recipe.accuracy={flag}"], out / flag) for flag in ("true", "false")}
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    on, off = runs["true"], runs["false"]
    rows_on = [r for r in on.metrics() if "train/loss" in r or "eval/loss" in r]
    rows_off = [r for r in off.metrics() if "train/loss" in r or "eval/loss" in r]
    assert [r.get("train/loss", r.get("eval/loss")) for r in rows_on] == \
        [r.get("train/loss", r.get("eval/loss")) for r in rows_off]  # bit for bit: accuracy only watched
    assert all("train/accuracy" in r or "eval/accuracy" in r for r in rows_on)
    assert not any(k.endswith("accuracy") for r in rows_off for k in r)
    assert "final/accuracy" in on.results() and not any(k.endswith("accuracy") for k in off.results())
    assert off.results()["param_digests"] == on.results()["param_digests"]
    epoch_lines = {name: [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
                   for name, done in runs.items()}
    assert epoch_lines["false"] and not any("accuracy" in line for line in epoch_lines["false"])
    assert all("accuracy" in line for line in epoch_lines["true"])


def test_top1_correct_is_the_label_scoring_highest_ties_included_padding_excluded():
    """top1_correct compares the label's score with the row's maximum (what a compiled loss reads in its own
    pass): without ties the argmax's answer, a label tied with the highest counts, a -100 label never does."""
    import torch
    from trainer.recipe import top1_correct

    torch.manual_seed(0)
    logits = torch.randn(4, 9, 50)  # (batch, tokens, vocabulary): no ties among random floats
    labels = torch.randint(0, 50, (4, 9))
    labels[0, :5] = logits[0, :5].argmax(-1)  # some right, so both answers occur
    assert torch.equal(top1_correct(logits, labels), logits.argmax(-1) == labels)
    assert top1_correct(logits, labels).sum() >= 5
    tied = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
    assert top1_correct(tied, torch.tensor([2, 0])).tolist() == [True, True]  # argmax would say [False, True]
    assert top1_correct(tied, torch.tensor([0, 2])).tolist() == [False, False]
    padded = torch.tensor([-100, 1], dtype=torch.int32)  # an ignore index; int32 labels as some datasets give them
    assert top1_correct(tied, padded).tolist() == [False, True]


def _language_model_logits():
    """bf16 logits [batch, tokens, vocabulary] as a language model's head gives them, with labels: some right,
    one tied with the row's maximum, two -100 (padding), the rest random."""
    import torch

    torch.manual_seed(1)
    logits = torch.randn(3, 7, 50).bfloat16()
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :4] = logits[0, :4].float().argmax(-1)  # right
    top = logits[1, 2].float().argmax()
    other = (int(top) + 1) % 50
    logits[1, 2, other] = logits[1, 2, top]  # a tie: the label scores as high as the best
    labels[1, 2] = other
    labels[2, 5:] = -100
    return logits, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_language_models_loss_and_top1_in_one_function_are_the_criterion_and_top1_apart(smoothing):
    """recipes.gpt.next_token_loss_and_top1 (next_token_criterion's ``with_top1``, what graph.compile_model runs
    for the gpt and hf_causal_lm recipes so that the top-1 shares the loss's row maxima): the correctness is
    top1_correct's bit for bit (ties counted, padding not), the loss and its gradient next_token_criterion's mean."""
    import torch

    from recipes.gpt import next_token_criterion, next_token_loss_and_top1
    from trainer.recipe import top1_correct

    logits, labels = _language_model_logits()
    apart = logits.clone().requires_grad_()
    together = logits.clone().requires_grad_()
    loss = next_token_criterion(smoothing)(apart, labels, reduction="mean")
    loss.backward()
    fused_loss, correct = next_token_loss_and_top1(smoothing)(together, labels)
    fused_loss.backward()
    assert correct.shape == labels.shape and correct.dtype == torch.bool
    assert torch.equal(correct, top1_correct(logits, labels))
    assert correct[1, 2] and not correct[2, 5:].any() and correct[0, :4].all()
    assert fused_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert torch.allclose(together.grad.float(), apart.grad.float(), atol=1e-6)
    assert apart.grad[2, 5:].abs().sum() == 0 == together.grad[2, 5:].abs().sum()  # padding adds no gradient


def test_the_fused_loss_and_top1_is_used_only_with_the_criterion_and_correctness_it_stands_for():
    """The compiled step runs a criterion's ``with_top1`` (trainer.recipe.measure_with_top1) only beside
    top1_correct and only for the criterion object that carries it: a recipe whose criterion or correctness a user
    replaces (dataclasses.replace) computes its own again, never the language model's cross-entropy in its place."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from recipes.gpt import next_token_criterion
    from trainer.recipe import Datasets, Recipe, measure_with_top1, top1_correct

    criterion = next_token_criterion(0.0)
    recipe = Recipe(name="lm", model=torch.nn.Linear(2, 2), data=Datasets(train=[], test=[], source="none"),
                    preprocess=lambda batch, train: batch, criterion=criterion, correct=top1_correct)
    assert measure_with_top1(recipe) is criterion.with_top1
    logits, labels = _language_model_logits()
    loss, correct = measure_with_top1(recipe)(logits, labels)
    assert torch.equal(correct, top1_correct(logits, labels))

    def z_loss(output, target, reduction="none"):  # a user's own loss over the same logits
        return criterion(output, target, reduction) + 1e-4 * output.float().logsumexp(-1).pow(2).mean()

    assert measure_with_top1(dataclasses.replace(recipe, criterion=z_loss)) is None
    assert measure_with_top1(dataclasses.replace(recipe, correct=lambda out, y: out.argmax(-1) == y)) is None
    assert measure_with_top1(dataclasses.replace(recipe, criterion=F.cross_entropy)) is None
