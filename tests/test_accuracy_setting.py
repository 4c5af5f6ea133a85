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


CLASSES = 8
NEG = float("-inf")


def _argmax_cases(dtype):
    """Rows of logits over 8 classes, each with a label and what ``argmax`` (the first index among equal maxima)
    says of it: constant rows, ties at the label and before it, ties after it, rows of -inf, padding (-100 over a
    row whose class 0 scores highest) and a label past the vocabulary; then random rows, some labelled right."""
    import torch

    cases = [([0.5] * 8, 0, True),  # constant logits: argmax's 0 alone is right
             ([0.5] * 8, 3, False),
             ([1, 3, 3, 0, 0, 0, 0, 0], 1, True),  # tied after the label
             ([1, 3, 3, 0, 0, 0, 0, 0], 2, False),  # tied before the label
             ([3, 1, 3, 3, 0, 0, 0, 0], 0, True),
             ([3, 1, 3, 3, 0, 0, 0, 0], 3, False),
             ([0, 0, 0, 0, 0, 0, 2, 2], 7, False),
             ([NEG] * 8, 0, True),  # -inf throughout: argmax says 0
             ([NEG] * 8, 5, False),
             ([4, 1, 1, 1, 1, 1, 1, 1], -100, False),  # padding, over a row whose class 0 (the clamped -100) is best
             ([1, 1, 1, 1, 1, 1, 1, 4], CLASSES, False)]  # past the vocabulary, where clamping would land on the best
    fixed = torch.tensor([row for row, _, _ in cases], dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    scattered = torch.randn(12, CLASSES, generator=generator).to(dtype)
    scattered_labels = torch.randint(0, CLASSES, (12,), generator=generator)
    scattered_labels[:6] = scattered[:6].argmax(-1)
    logits = torch.cat([fixed, scattered])
    labels = torch.cat([torch.tensor([label for _, label, _ in cases]), scattered_labels]).int()  # as some datasets
    return logits, labels, [right for _, _, right in cases]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_top1_correct_is_argmaxs_answer_ties_going_to_the_first_maximum_padding_never(dtype):
    """top1_correct counts what argmax says, ties included (the first of equal maxima), as torchmetrics and
    transformers count it: constant logits score the label 0 alone, not every label; a -100 label never counts.
    label_scores_highest (the form a compiled loss reads beside its own maxima) gives the same answer."""
    import torch

    from trainer.recipe import label_scores_highest, top1_correct

    logits, labels, expected = _argmax_cases(getattr(torch, dtype))
    by_argmax = logits.argmax(-1) == labels
    assert by_argmax[:len(expected)].tolist() == expected
    assert torch.equal(top1_correct(logits, labels), by_argmax)
    assert torch.equal(label_scores_highest(logits, labels, logits.amax(-1)), by_argmax)
    assert 6 <= int(by_argmax.sum()) < len(labels)


def test_compiled_top1_is_argmaxs_answer_too(monkeypatch):
    """Under torch.compile (graph.compile_model; Inductor on the CPU here, the GPU test has the CUDA kernels)
    top1_correct and the language model's loss-and-top1 give argmax's answer on the same ties, bit for bit."""
    import torch

    # Inductor's CPU build imports setuptools, whose distutils shim refuses to load once an earlier test in this
    # process imported the standard library's distutils (as in tests/test_fsdp.py): keep the standard one
    monkeypatch.setenv("SETUPTOOLS_USE_DISTUTILS", "stdlib")
    from recipes.gpt import next_token_loss_and_top1
    from trainer.recipe import top1_correct

    logits, labels, _ = _argmax_cases(torch.bfloat16)
    in_vocabulary = labels < CLASSES  # the loss takes no label past the vocabulary (-100 it skips)
    logits, labels = logits[in_vocabulary], labels[in_vocabulary]
    loss_and_top1 = next_token_loss_and_top1(0.0)

    def both(output, target):  # one compile for the two forms
        return top1_correct(output, target), loss_and_top1(output[None], target[None])[1][0]

    alone, with_loss = torch.compile(both, dynamic=False)(logits, labels)
    by_argmax = logits.argmax(-1) == labels
    assert torch.equal(alone, by_argmax) and torch.equal(with_loss, by_argmax)


def _language_model_logits():
    """bf16 logits [batch, tokens, vocabulary] as a language model's head gives them, with labels: some right,
    one tied with a later logit (right: argmax picks the label), one tied with an earlier one (wrong), two -100
    (padding), the rest random."""
    import torch

    torch.manual_seed(1)
    logits = torch.randn(3, 7, 50).bfloat16()
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :4] = logits[0, :4].float().argmax(-1)  # right
    logits[1, 2:4, 10] = logits[1, 2:4, 30] = 8.0  # two maxima in each of two rows
    labels[1, 2], labels[1, 3] = 10, 30  # the first of them (right), the second (wrong)
    labels[2, 5:] = -100
    return logits, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_language_models_loss_and_top1_in_one_function_are_the_criterion_and_top1_apart(smoothing):
    """recipes.gpt.next_token_loss_and_top1 (next_token_criterion's ``with_top1``, what graph.compile_model runs
    for the gpt and hf_causal_lm recipes so that the top-1 shares the loss's row maxima): the correctness is
    top1_correct's bit for bit (argmax's: a tie goes to the first maximum; padding never counts), the loss and
    its gradient next_token_criterion's mean."""
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
    assert torch.equal(correct, logits.argmax(-1) == labels)
    assert correct[1, 2] and not correct[1, 3] and not correct[2, 5:].any() and correct[0, :4].all()
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
