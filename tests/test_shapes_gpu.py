"""Several input shapes on a GPU: one graph per shape, in one memory pool, replayed in any
order, equal to eager step for step; and the trainer's last partial batch of each epoch,
trained as a step of its own graph, equal to eager.

Run on the GPU machine: ``pytest -m gpu tests/test_shapes_gpu.py -s`` (prints the pools);
the two-rank case needs two GPUs.
"""
from __future__ import annotations

import json
import math

import pytest

from helpers.availability import cuda_count
from helpers.launches import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(cuda_count() < 2, reason="needs 2 GPUs")

# Graphed against eager per step: the same kernels, but attention's backward is not bitwise
# deterministic. A graph replaying another shape's buffers, or reading memory another graph
# reused, is off by far more (a different batch's loss).
LOSS_RTOL = 1e-3


def run_loop(tmp_path, nproc: int) -> dict:
    out = tmp_path / "shapes.json"
    proc = launch(["--out", str(out)], script="tests/helpers/shape_buckets_loop.py", nproc=nproc, timeout=300,
                  log_dir=tmp_path / "logs", env={"NCCL_NVLS_ENABLE": "0"})
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=two_gpus)])
def test_shapes_in_random_order_replay_their_own_graphs_equal_to_eager_step_for_step(tmp_path, nproc):
    res = run_loop(tmp_path, nproc)
    eager, full, alone = res["eager"], res["full"], res["largest_alone"]
    assert sorted(g["shape"] for g in full["graphs"]) == sorted(
        ["12x32:int64,12x32:int64", "12x64:int64,12x64:int64", "12x96:int64,12x96:int64", "8x96:int64,8x96:int64"])
    assert eager["graphs"] == []
    for step, (a, b) in enumerate(zip(eager["losses"], full["losses"])):
        assert b == pytest.approx(a, rel=LOSS_RTOL), f"step {step}: eager {a} graphed {b}"
    assert full["losses"][-1] < 0.8 * full["losses"][0]  # it learns
    assert full["param_sum"] == pytest.approx(eager["param_sum"], rel=1e-3)
    ratio = full["pool_mib"] / alone["pool_mib"]
    print(f"\n{nproc} rank(s): pool of 4 shapes' graphs {full['pool_mib']:.1f} MiB, of the largest alone "
          f"{alone['pool_mib']:.1f} MiB ({ratio:.2f}x); peak allocated eager {eager['peak_allocated_mib']:.0f} MiB, "
          f"graphed {full['peak_allocated_mib']:.0f} MiB; captures "
          + ", ".join(f"{g['shape'].split(',')[0]} {g['capture_s'] * 1e3:.0f} ms" for g in full["graphs"]))


COMMON = ["logger=none", "train.progress=false", "train.log_every=4", "deterministic=true", "train.epochs=3"]
RECIPES = {  # 1000 samples at 64 per step: 15 full steps and a tail of 40 per epoch (20 per rank on two)
    "mnist": ["recipe=mnist", "recipe.data.source=synthetic", "recipe.data.train_size=1000",
              "recipe.data.test_size=256", "recipe.data.batch_size=64"],
    "cifar10_resnet18": ["recipe=cifar10_resnet18", "recipe.data.source=synthetic", "recipe.data.train_size=1000",
                         "recipe.data.test_size=256", "recipe.data.batch_size=64",
                         "recipe.data.eval_batch_size=128"],
}
REL_TOLERANCE = {"mnist": 1e-4, "cifar10_resnet18": 2e-3}  # as tests/test_recipes_gpu.py, for ResNet's BatchNorm


def _losses(done):
    return [(m["step"], m["train/loss"], m["train/accuracy"]) for m in done.metrics() if "train/loss" in m]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_last_partial_batch_trains_in_its_own_graph_like_eager(out, recipe):
    runs = {mode: launch([*COMMON, *RECIPES[recipe], f"graph={mode}"], out / mode, timeout=600)
            for mode in ("eager", "full")}
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-4000:]
    e, g = runs["eager"].results(), runs["full"].results()
    assert e["steps"] == g["steps"] == 3 * 16  # the tail is a step: 16 per epoch
    # Its graph is captured at its second appearance (shape_warmup_iters=1), and replayed at the third.
    assert g["graph/graphs"] == 3 and g["graph/train@tail40/capture_s"] > 0 and g["graph/train@full/capture_s"] > 0
    assert g["graph/train@tail40/pool_mib"] >= g["graph/train@full/pool_mib"]  # the pool as it grew
    eager, graph = _losses(runs["eager"]), _losses(runs["full"])
    assert [s for s, _, _ in eager] == [s for s, _, _ in graph] and 48 in [s for s, _, _ in graph]
    rel = REL_TOLERANCE[recipe]
    for (step, le, ae), (_, lg, ag) in zip(eager, graph):
        assert math.isfinite(le) and lg == pytest.approx(le, rel=rel), f"step {step}: eager {eager}\ngraph {graph}"
        assert ag == pytest.approx(ae, abs=0.01)
    assert g["final/eval_loss"] == pytest.approx(e["final/eval_loss"], rel=rel)


GPT_BUCKETS = ["recipe=gpt_tiny", "recipe.model.n_layer=2", "recipe.model.n_head=4", "recipe.model.d_model=128",
               "recipe.model.context=128", "recipe.data.source=synthetic", "recipe.data.train_size=1024",
               "recipe.data.test_size=96", "recipe.data.batch_size=16", "recipe.data.eval_batch_size=32",
               "recipe.optim.lr=1e-3", "recipe.schedule.warmup_steps=5", "recipe.data.seq_len_buckets=[32,64,128]",
               "logger=none", "train.progress=false", "train.log_every=5", "deterministic=true", "train.max_steps=60"]


def test_gpt_tiny_over_three_sequence_length_buckets_graphed_trains_like_eager(out):
    runs = {mode: launch([*GPT_BUCKETS, f"graph={mode}"], out / mode, timeout=600) for mode in ("eager", "full")}
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-4000:]
    e, g = runs["eager"].results(), runs["full"].results()
    # 64 steps per epoch, no tail: one graph per bucket (the first, 32, is captured after DDP's 11
    # warm-up steps, as its share is 20 steps), and the evaluation's.
    assert g["graph/graphs"] == 4 and {"graph/train@full@T32/capture_s", "graph/train@full@T64/capture_s",
                                       "graph/train@full/capture_s"} <= g.keys()
    eager, graph = _losses(runs["eager"]), _losses(runs["full"])
    assert [s for s, _, _ in eager] == [s for s, _, _ in graph]
    for (step, le, _), (_, lg, _) in zip(eager, graph):  # tests/test_recipes_gpu.py's tolerance for gpt_tiny
        assert math.isfinite(le) and lg == pytest.approx(le, rel=2e-2), f"step {step}: eager {eager}\ngraph {graph}"
    assert g["final/eval_loss"] == pytest.approx(e["final/eval_loss"], rel=2e-2)
    rows = []
    for length in (32, 64):
        assert g[f"perf/bucket_T{length}/steps_timed"] > 0 and e[f"perf/bucket_T{length}/steps_timed"] > 0
        rows.append(f"T{length}: eager {e[f'perf/bucket_T{length}/tokens_per_s']:,.0f} tokens/s, graphed "
                    f"{g[f'perf/bucket_T{length}/tokens_per_s']:,.0f}")
    rows.append(f"T128: eager {e['perf/tokens_per_s']:,.0f} tokens/s, graphed {g['perf/tokens_per_s']:,.0f}")
    print("\n" + "; ".join(rows))
