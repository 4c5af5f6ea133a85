"""The CIFAR-10 ResNet-18 and tiny-GPT recipes on a GPU: graphed training gives the same results
as eager training, and the other graph modes run them.

Run on the GPU machine: ``pytest -m gpu tests/test_recipes_gpu.py``. Skipped without CUDA.
"""
from __future__ import annotations

import math

import pytest

from helpers.availability import cuda_count
from helpers.launches import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]

STEPS = 30  # > graph.warmup_iters (11): about 18 of them replay the captured graph
COMMON = ["experiment=debug", "logger=none", "train.progress=false", "train.log_every=5"]
# Deterministic kernels (cuDNN, cuBLAS workspace) for the eager-vs-graph comparison.
SAME_RUNS = [*COMMON, "deterministic=true", f"train.max_steps={STEPS}"]
RECIPES = {
    # bf16 (precision=auto on CUDA), channels_last; 64 steps per epoch, so all STEPS fall in one epoch; 4 eval batches (the last
    # three replay the eval graph).
    "cifar10_resnet18": ["recipe=cifar10_resnet18", "recipe.data.train_size=4096", "recipe.data.test_size=512",
                         "recipe.data.batch_size=64", "recipe.data.eval_batch_size=128",
                         "recipe.schedule.warmup_steps=5"],
    # bf16 (the recipe's default), AdamW, grad clipping, a small model.
    "gpt_tiny": ["recipe=gpt_tiny", "recipe.model.n_layer=2", "recipe.model.n_head=4", "recipe.model.d_model=128",
                 "recipe.model.context=128", "recipe.data.train_size=1024", "recipe.data.test_size=96",
                 "recipe.data.batch_size=16", "recipe.data.eval_batch_size=32", "recipe.optim.lr=1e-3",
                 "recipe.schedule.warmup_steps=5"],
}
# Graph and eager run the same kernels on the same data; what is left is reduction order
# in a few kernels, amplified by training. A graph that replays stale inputs, skips the
# optimizer or loses the BatchNorm updates moves these numbers by far more.
REL_TOLERANCE = {"cifar10_resnet18": 2e-3, "gpt_tiny": 2e-2}


def _train_losses(done):
    return [(m["step"], m["train/loss"]) for m in done.metrics() if "train/loss" in m]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_full_graph_trains_like_eager_from_the_same_seed(out, recipe):
    import torch

    from trainer.metrics.perf import peak_tflops

    eager = launch([*SAME_RUNS, *RECIPES[recipe], "graph=eager"], out / "eager", timeout=600)
    graph = launch([*SAME_RUNS, *RECIPES[recipe], "graph=full"], out / "full", timeout=600)
    for done in (eager, graph):
        assert done.returncode == 0, done.stderr[-4000:]
    e, g = eager.results(), graph.results()
    assert (e["mode"], g["mode"]) == ("eager", "full") and e["steps"] == g["steps"] == STEPS
    assert g["timed_phase"] == "graph" and g["graph/train_capture_s"] > 0 and g["graph/eval_capture_s"] > 0

    rel = REL_TOLERANCE[recipe]
    same_params = e["param_digests"] == g["param_digests"]
    why = f"eager {_train_losses(eager)}\ngraph {_train_losses(graph)}\nbitwise-equal parameters: {same_params}"
    assert [s for s, _ in _train_losses(eager)] == [s for s, _ in _train_losses(graph)], why
    for (step, le), (_, lg) in zip(_train_losses(eager), _train_losses(graph)):
        assert math.isfinite(le) and lg == pytest.approx(le, rel=rel), f"train loss at step {step}\n{why}"
    unit = "tokens" if recipe == "gpt_tiny" else "samples"
    assert g[f"final/eval_{unit}"] == e[f"final/eval_{unit}"]
    assert g["final/eval_loss"] == pytest.approx(e["final/eval_loss"], rel=rel), why
    # A sample or two near a decision boundary may flip: 1% of the test set, not more.
    assert g["final/eval_accuracy"] == pytest.approx(e["final/eval_accuracy"], abs=0.01), why
    losses = [loss for _, loss in _train_losses(graph)]
    assert min(losses[1:]) < losses[0], f"no training progress: {why}"

    assert g["precision"] == e["precision"] == "bf16"  # both recipes' default on CUDA
    peak = peak_tflops(torch.cuda.get_device_name(0), g["precision"])
    if peak is not None:  # a GPU in the MFU table: MFU is reported, against the named peak
        assert g["perf/mfu_peak"] == peak[0] and g["perf/mfu_peak_tflops"] == peak[1]
        assert 0 < g["perf/mfu_pct"] < 100 and 0 < e["perf/mfu_pct"] < 100


# Compiled kernels fuse and reorder reductions: bf16 rounding differs from eager's step by step.
COMPILED_TOLERANCE = 2e-2


@pytest.mark.parametrize("recipe,extra", [("cifar10_resnet18", []), ("gpt_tiny", []),
                                          ("gpt_tiny", ["recipe.accuracy=false"])],
                         ids=["cifar10_resnet18", "gpt_tiny", "gpt_tiny-accuracy_off"])
def test_the_model_compiled_with_its_loss_in_the_graph_trains_like_eager(out, recipe, extra):
    """graph=full_compiled compiles the model and its loss as one function (trainer/step/steps.py
    ModelAndLoss) inside the whole-step graph: its losses follow eager's from the same seed, and the
    training accuracy it counts inside that function (top1_correct beside the loss; for gpt_tiny the criterion's
    with_top1, one row maximum for both) follows eager's, which the metrics stream counts from the
    output."""
    eager = launch([*SAME_RUNS, *RECIPES[recipe], *extra, "graph=eager"], out / "eager", timeout=600)
    compiled = launch([*SAME_RUNS, *RECIPES[recipe], *extra, "graph=full_compiled"], out / "compiled", timeout=600)
    for done in (eager, compiled):
        assert done.returncode == 0, done.stderr[-4000:]
    e, c = eager.results(), compiled.results()
    assert c["mode"] == "full" and c["timed_phase"] == "graph" and c["graph/train_capture_s"] > 0
    why = f"eager {_train_losses(eager)}\ncompiled {_train_losses(compiled)}"
    assert [s for s, _ in _train_losses(eager)] == [s for s, _ in _train_losses(compiled)], why
    for (step, le), (_, lc) in zip(_train_losses(eager), _train_losses(compiled)):
        assert math.isfinite(lc) and lc == pytest.approx(le, rel=COMPILED_TOLERANCE), f"train loss at step {step}\n{why}"
    assert c["final/eval_loss"] == pytest.approx(e["final/eval_loss"], rel=COMPILED_TOLERANCE), why
    if "recipe.accuracy=false" in extra:
        assert not any(k.endswith("accuracy") for k in c) and not any(
            k.endswith("accuracy") for row in compiled.metrics() for k in row)
    else:
        accuracies = [[(m["step"], m["train/accuracy"]) for m in done.metrics() if "train/accuracy" in m]
                      for done in (eager, compiled)]
        assert accuracies[0] and [s for s, _ in accuracies[0]] == [s for s, _ in accuracies[1]], accuracies
        # Two trajectories whose losses agree within COMPILED_TOLERANCE still predict some of a window's 320
        # samples differently, more as they drift apart (2 H200s: 0.203 against 0.256 at step 30, 2.2 binomial
        # standard deviations). So the runs' accuracy is compared over all windows; whether the count inside the
        # compiled loss is exact is test_the_correctness_counted_inside_the_compiled_loss_is_the_outputs_own.
        assert all(0 < a <= 1 for run in accuracies for _, a in run), accuracies
        means = [sum(a for _, a in run) / len(run) for run in accuracies]
        assert means[1] == pytest.approx(means[0], abs=0.03), f"mean train accuracy {means}: {accuracies}"


@pytest.mark.parametrize("classes,rows", [(10, 512), (50304, 2048)], ids=["classifier", "language-model"])
def test_the_correctness_counted_inside_the_compiled_loss_is_the_outputs_own(classes, rows):
    """graph.compile_model computes top1_correct in the loss's compiled function (trainer/step/steps.py
    ModelAndLoss): on the GPU, in bf16, with -100 padding labels and tied scores, that count is exactly
    top1_correct of the output the same function returns, and the loss is the output's cross-entropy."""
    import torch
    import torch.nn.functional as F

    from trainer.recipe import top1_correct
    from trainer.step.steps import ModelAndLoss, loss_and_correct, mean_loss

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, classes)).cuda()
    with torch.no_grad():  # two classes share a weight row: their bf16 scores tie on every row
        model[2].weight[1].copy_(model[2].weight[0])
        model[2].bias[1].copy_(model[2].bias[0])
    measure = loss_and_correct(mean_loss(F.cross_entropy), top1_correct)
    fused = torch.compile(ModelAndLoss(model, lambda m, batch: m(batch["x"]), measure, "cuda"))
    x = torch.randn(rows, 64, device="cuda")
    y = torch.randint(0, classes, (rows,), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        y[2::5] = model(x)[2::5].argmax(-1)  # rows the model gets right (up to compiled bf16 rounding)
    y[1::11] = 1  # the label tied with class 0, which argmax picks first: never right
    y[::7] = -100  # padding
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, loss, correct = fused({"x": x, "y": y}, True)
        _, loss_alone, correct_alone = fused({"x": x, "y": y}, False)
    assert out.dtype == torch.bfloat16 and correct.dtype == torch.bool
    assert torch.equal(correct, top1_correct(out, y)) and torch.equal(correct, out.argmax(-1) == y)
    assert not correct[::7].any() and not correct[1::11].any() and 0 < int(correct.sum()) < rows
    # The loss of bf16 logits comes back in bf16 (8 bits of mantissa).
    assert loss.item() == pytest.approx(F.cross_entropy(out.float(), y).item(), rel=1e-2)
    # The training step asks for no output: other kernels, the same logits up to bf16 rounding.
    assert abs(int(correct_alone.sum()) - int(correct.sum())) <= rows // 100
    assert loss_alone.item() == pytest.approx(loss.item(), rel=1e-2)


def test_the_language_models_loss_and_top1_compiled_are_the_criterion_and_top1_apart():
    """recipes.gpt.next_token_loss_and_top1 compiled on the GPU (what graph.compile_model runs for the gpt and
    hf_causal_lm recipes, the top-1 read from the loss's own online-softmax maxima) over GPT-2's vocabulary in
    bf16, with ties (the first maximum is argmax's, a later one is not; constant rows) and -100 padding:
    top1_correct's answer and argmax's bit for bit, next_token_criterion's loss and gradient to rounding."""
    import torch

    from recipes.gpt import next_token_criterion, next_token_loss_and_top1
    from trainer.recipe import top1_correct

    torch.manual_seed(0)
    logits = torch.randn(4, 512, 50304, device="cuda").bfloat16()
    labels = torch.randint(0, 50304, (4, 512), device="cuda")
    labels[:, ::3] = logits[:, ::3].float().argmax(-1)  # right
    logits[1, 1:3, 100] = logits[1, 1:3, 200] = 8.0  # two maxima (above any randn) in each of two rows
    labels[1, 1], labels[1, 2] = 100, 200  # the first (right) and the second (wrong)
    logits[2, 4:6] = 0.25  # constant rows: label 0 alone is right
    labels[2, 4], labels[2, 5] = 0, 7
    labels[:, -7:] = -100  # padding
    apart, together = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = next_token_criterion(0.0)(apart, labels, reduction="mean")
    loss.backward()
    fused_loss, correct = torch.compile(next_token_loss_and_top1(0.0))(together, labels)
    fused_loss.backward()
    assert torch.equal(correct, top1_correct(logits, labels)) and torch.equal(correct, logits.argmax(-1) == labels)
    assert correct[1, 1] and not correct[1, 2] and correct[2, 4] and not correct[2, 5]
    assert not correct[:, -7:].any() and int(correct.sum()) >= 4 * 160
    assert fused_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    torch.testing.assert_close(together.grad.float(), apart.grad.float(), rtol=2e-2, atol=1e-9)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("graph,mode", [("full_compiled", "full"), ("partial", "partial")])
def test_compiled_and_partial_graphs_run_the_recipe(out, recipe, graph, mode):
    done = launch([*COMMON, *RECIPES[recipe], f"graph={graph}", "train.max_steps=16"], out, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    res = done.results()
    assert res["mode"] == mode and res["steps"] == 16
    assert math.isfinite(res["final/loss"]) and math.isfinite(res["final/eval_loss"])
    if graph == "full_compiled":
        assert res["graph/train_capture_s"] > 0  # the compiled model was captured inside the whole-step graph
