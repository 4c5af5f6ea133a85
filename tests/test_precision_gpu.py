"""train.precision=fp16 on a GPU: fp16 autocast with a dynamic loss scale, the whole scaler inside
the captured step (scale, unscale before clipping, skip on inf, scale update), graphed equal to
eager; an overflow skips the step and halves the scale in the graph exactly as eagerly; the scale
grows back after its interval; a resumed fp16 run continues bit for bit.

Run on the GPU machine: ``pytest -m gpu tests/test_precision_gpu.py``.
"""
from __future__ import annotations

import math

import pytest
import torch

import graphing
from helpers.availability import cuda_count
from helpers.doctor_gallery import fp16_scaled_step
from helpers.launches import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]

STEPS = 30
COMMON = ["experiment=debug", "logger=none", "train.progress=false", "train.log_every=5", "deterministic=true",
          "train.precision=fp16"]
RECIPES = {
    "mnist": ["recipe=mnist", "recipe.data.source=synthetic", "recipe.data.train_size=4096",
              "recipe.data.test_size=512", "recipe.data.batch_size=64"],
    "cifar10_resnet18": ["recipe=cifar10_resnet18", "recipe.data.train_size=4096", "recipe.data.test_size=512",
                         "recipe.data.batch_size=64", "recipe.data.eval_batch_size=128",
                         "recipe.schedule.warmup_steps=5", "train.grad_clip=1.0"],  # clipping: unscale_ first
}
# The same kernels on the same data; reduction order in a few kernels remains (as for bf16 in
# test_recipes_gpu.py). A graph that froze the scale or skipped the optimizer differs by far more.
REL = 2e-3


def _losses(done):
    return [(m["step"], m["train/loss"]) for m in done.metrics() if "train/loss" in m]


@pytest.mark.parametrize("recipe,nproc", [("mnist", None), ("cifar10_resnet18", None),
                                          pytest.param("mnist", 2, marks=pytest.mark.skipif(
                                              cuda_count() < 2, reason="needs 2 GPUs"))])
def test_fp16_graphed_trains_like_fp16_eager(out, recipe, nproc):
    runs = {mode: launch([*COMMON, *RECIPES[recipe], f"train.max_steps={STEPS}", f"graph={mode}"], out / mode,
                         nproc=nproc, timeout=600) for mode in ("eager", "full")}
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-4000:]
    e, g = runs["eager"].results(), runs["full"].results()
    assert e["precision"] == g["precision"] == "fp16" and g["timed_phase"] == "graph"
    eager, graph = _losses(runs["eager"]), _losses(runs["full"])
    assert [s for s, _ in eager] == [s for s, _ in graph]
    for (step, a), (_, b) in zip(eager, graph):
        assert math.isfinite(a) and b == pytest.approx(a, rel=REL), f"step {step}: eager {eager}\ngraph {graph}"
    assert g["final/eval_loss"] == pytest.approx(e["final/eval_loss"], rel=REL)


def test_a_resumed_fp16_run_continues_bit_for_bit(out):
    # A short growth interval, so that the scale (and so the rounding of every gradient) changes
    # during the run: a resume that lost the scaler's state would not end bitwise equal.
    args = [*COMMON, *RECIPES["mnist"], "graph=full", "train.loss_scale.growth_interval=7", "checkpoint.every_steps=20"]
    clean = launch([*args, "train.max_steps=40"], out / "clean", timeout=600)
    run_dir = out / "resumed" / "run"  # the same directory twice: the second run resumes the first
    first = launch([*args, "train.max_steps=20", f"run_dir={run_dir}"], out / "resumed", timeout=600)
    second = launch([*args, "train.max_steps=40", f"run_dir={run_dir}"], out / "resumed", timeout=600)
    for done in (clean, first, second):
        assert done.returncode == 0, done.stderr[-4000:]
    assert "resumed from" in second.stdout + second.stderr
    a, b = clean.results(), second.results()
    assert a["steps"] == b["steps"] == 40
    assert b["param_digests"] == a["param_digests"]


def _scaled_loop(mode: str, overflow_at: int, steps: int = 24):
    """A GraphedStep loop with the documented GradScaler usage; the loop pushes the loss to inf at one step
    (through a device tensor it writes in place). Returns each step's (scale after it, params after it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=3)
    boost = torch.ones((), device="cuda")  # 1, or inf at the chosen step

    step = graphing.GraphedStep(fp16_scaled_step(optimizer, scaler, boost), model, optimizer, mode=mode, warmup_iters=3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
    seen = []
    for i in range(steps):
        boost.fill_(float("inf") if i == overflow_at else 1.0)
        step(x, y)
        seen.append((scaler._scale.item(), [p.detach().clone() for p in model.parameters()]))
    phase = step.phase
    step.close()
    return seen, phase


def test_an_overflow_skips_the_step_and_halves_the_scale_in_the_graph_as_eagerly():
    at = 10  # after the capture (warm-up 3, capture at the 4th call)
    eager, eager_phase = _scaled_loop("eager", at)
    graph, graph_phase = _scaled_loop("full", at)
    assert (eager_phase, graph_phase) == ("eager", "graph")
    scales = [s for s, _ in graph]
    assert scales == [s for s, _ in eager]  # the same scale after every step
    assert scales[at] == scales[at - 1] / 2  # the overflow halved it, in the graph
    for before, after in zip(graph[at - 1][1], graph[at][1]):
        assert torch.equal(before, after)  # and the step was skipped: no parameter moved
    assert scales[at + 3] == scales[at] * 2  # three good steps later it grew back
    for (_, pe), (_, pg) in zip(eager, graph):
        for a, b in zip(pe, pg):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)  # float lr eagerly, a tensor lr in the graph
