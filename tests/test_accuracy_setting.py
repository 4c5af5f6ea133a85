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
