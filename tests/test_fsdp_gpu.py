"""train.parallel=fsdp2 on a GPU: the whole sharded step (FSDP2's all-gathers and reduce-scatters, clipping
on DTensor gradients, AdamW on the shards, the schedule) captured as one graph per rank and replayed equal to
eager, step for step, in fp32 and bf16, with reshard_after_forward true and false; graph=full_compiled (each
block compiled, the whole step captured) within the compiled tolerance of eager.

One GPU runs it as a process group of one (FSDP2's collectives and streams all run); two GPUs run the same
tests under torchrun (``nproc``). Run on the GPU machine: ``pytest -m gpu tests/test_fsdp_gpu.py``.
"""
from __future__ import annotations

import math

import pytest

from helpers.availability import cuda_count
from helpers.launches import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]

STEPS = 30  # train.max_steps: 11 eager warm-up steps, then the captured graph replays
TRAIN_SIZE = {"gpt_tiny": 1024, "mnist": 2048}
BATCH = {"gpt_tiny": 16, "mnist": 64}  # per rank: mnist's epoch ends before train.max_steps on 2 GPUs (16 steps)
COMMON = ["logger=none", "train.progress=false", "train.log_every=1", f"train.max_steps={STEPS}", "train.epochs=1",
          "deterministic=true", "train.parallel=fsdp2"]
RECIPES = {
    "gpt_tiny": ["recipe=gpt_tiny", "recipe.model.n_layer=2", "recipe.model.n_head=4", "recipe.model.d_model=128",
                 "recipe.model.context=128", f"recipe.data.train_size={TRAIN_SIZE['gpt_tiny']}",
                 "recipe.data.test_size=96", f"recipe.data.batch_size={BATCH['gpt_tiny']}",
                 "recipe.data.eval_batch_size=32", "recipe.optim.lr=1e-3", "recipe.schedule.warmup_steps=5",
                 "train.grad_clip=1.0"],
    # SGD has no fused kernel on DTensor shards (refused in a graph under fsdp2): AdamW, as the refusal says.
    "mnist": ["recipe=mnist", "recipe.data.source=synthetic", f"recipe.data.train_size={TRAIN_SIZE['mnist']}",
              f"recipe.data.batch_size={BATCH['mnist']}", "recipe.data.test_size=512", "recipe.data.eval_batch_size=128",
              "recipe.optim._target_=torch.optim.AdamW", "~recipe.optim.momentum", "recipe.optim.lr=1e-3",
              "train.grad_clip=1.0"],
}
CASES = [("gpt_tiny", "bf16", "true"), ("gpt_tiny", "fp32", "false"), ("mnist", "bf16", "true"),
         ("mnist", "fp32", "false")]


def _losses(done):
    return [(m["step"], m["train/loss"]) for m in done.metrics() if "train/loss" in m]


def _nproc():
    return 2 if cuda_count() >= 2 else None


def _expected_steps(recipe: str) -> int:
    """train.epochs=1: one epoch's steps on this many ranks (the split has no tail), at most train.max_steps."""
    return min(STEPS, TRAIN_SIZE[recipe] // (BATCH[recipe] * (_nproc() or 1)))


@pytest.mark.parametrize("recipe, precision, reshard", CASES)
def test_fsdp2_full_graph_trains_step_for_step_like_fsdp2_eager(out, recipe, precision, reshard):
    args = [*COMMON, *RECIPES[recipe], f"train.precision={precision}", f"train.fsdp.reshard_after_forward={reshard}"]
    eager = launch([*args, "graph=eager"], out / "eager", nproc=_nproc(), timeout=400)
    graph = launch([*args, "graph=full"], out / "full", nproc=_nproc(), timeout=400)
    for done in (eager, graph):
        assert done.returncode == 0, done.output[-4000:]
    e, g = eager.results(), graph.results()
    assert (e["mode"], g["mode"]) == ("eager", "full") and g["timed_phase"] == "graph"
    assert g["graph/train_capture_s"] > 0 and g["graph/eval_capture_s"] > 0
    # The same kernels on the same data: fp32 agrees to rounding; bf16 within a few of its rounding steps.
    rel = 1e-4 if precision == "fp32" else 2e-2
    why = (f"world size {e['world_size']} and {g['world_size']}, steps {e['steps']} and {g['steps']}\n"
           f"eager {_losses(eager)}\ngraph {_losses(graph)}")
    steps = _expected_steps(recipe)
    assert e["steps"] == g["steps"] == steps, why  # one epoch, also where it ends before train.max_steps
    assert [s for s, _ in _losses(eager)] == [s for s, _ in _losses(graph)] == list(range(1, steps + 1)), why
    for (step, le), (_, lg) in zip(_losses(eager), _losses(graph)):
        assert math.isfinite(le) and lg == pytest.approx(le, rel=rel), f"train loss at step {step}\n{why}"
    assert g["final/eval_loss"] == pytest.approx(e["final/eval_loss"], rel=rel), why
    losses = [loss for _, loss in _losses(graph)]
    assert min(losses[1:]) < losses[0], f"no training progress: {why}"



# Compiled kernels fuse and reorder reductions: the tolerance DDP's full_compiled is held to
# (tests/test_recipes_gpu.py COMPILED_TOLERANCE).
COMPILED_TOLERANCE = 2e-2


@pytest.mark.parametrize("reshard", ["true", "false"])
def test_fsdp2_compiled_blocks_in_the_graph_train_like_fsdp2_eager(out, reshard):
    """graph=full_compiled under fsdp2 compiles each sharded block (FSDP2's hooks stay eager,
    graphing/full.py compile_sharded_units) and captures the whole step: its losses follow eager's."""
    args = [*COMMON, *RECIPES["gpt_tiny"], "train.precision=bf16", f"train.fsdp.reshard_after_forward={reshard}"]
    eager = launch([*args, "graph=eager"], out / "eager", nproc=_nproc(), timeout=400)
    compiled = launch([*args, "graph=full_compiled"], out / "compiled", nproc=_nproc(), timeout=600)
    for done in (eager, compiled):
        assert done.returncode == 0, done.output[-4000:]
    e, c = eager.results(), compiled.results()
    assert c["mode"] == "full" and c["timed_phase"] == "graph" and c["graph/train_capture_s"] > 0
    why = f"world size {c['world_size']}\neager {_losses(eager)}\ncompiled {_losses(compiled)}"
    steps = _expected_steps("gpt_tiny")
    assert e["steps"] == c["steps"] == steps, why
    assert [s for s, _ in _losses(eager)] == [s for s, _ in _losses(compiled)] == list(range(1, steps + 1)), why
    for (step, le), (_, lc) in zip(_losses(eager), _losses(compiled)):
        assert math.isfinite(lc) and lc == pytest.approx(le, rel=COMPILED_TOLERANCE), f"train loss at step {step}\n{why}"
    assert c["final/eval_loss"] == pytest.approx(e["final/eval_loss"], rel=COMPILED_TOLERANCE), why
