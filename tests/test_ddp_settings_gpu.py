"""``train.ddp`` on GPUs over NCCL: DDP's bucket size, bf16 gradient all-reduce, static graph
and the per-forward buffer broadcast are captured in the whole-step graph and train as the
recipe's settings do; without the broadcast, two ranks still evaluate rank 0's model.

Runs under torchrun on every GPU of the machine, up to two (one rank still builds DDP and its
NCCL all-reduce). ``pytest -m gpu tests/test_ddp_settings_gpu.py``; skipped without CUDA.
"""
from __future__ import annotations

import json
import math

import pytest

from helpers.availability import cuda_count
from helpers.launches import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]

CIFAR = ["recipe=cifar10_resnet18", "recipe.data.source=synthetic", "recipe.data.train_size=8192",
         "recipe.data.test_size=512", "recipe.data.batch_size=128", "train.max_steps=40", "train.log_every=10",
         "train.eval=false", "logger=none", "train.progress=false", "graph=full"]
# bf16 rounds each rank's gradient before the sum: the loss drifts from fp32's by that rounding.
REL_TOLERANCE = 2e-2


@pytest.mark.parametrize("settings", [["train.ddp.grad_reduce=bf16", "train.ddp.bucket_cap_mb=2"],
                                      ["train.ddp.static_graph=true"], ["train.ddp.broadcast_buffers=true"]],
                         ids=["bf16-buckets-2mb", "static-graph", "buffer-broadcast"])  # the recipe has it off
def test_ddp_settings_are_captured_and_train_like_the_defaults(out, settings):
    nproc = min(cuda_count(), 2)
    default = launch(CIFAR, out / "default", nproc=nproc, timeout=300)
    tuned = launch([*CIFAR, *settings], out / "tuned", nproc=nproc, timeout=300)
    for done in (default, tuned):
        assert done.returncode == 0, done.stderr[-4000:]
    d, t = default.results(), tuned.results()
    assert t["mode"] == "full" and t["timed_phase"] == "graph" and t["graph/train_capture_s"] > 0
    assert "graph/fallback" not in t, t.get("graph/fallback")
    assert len(set(t["param_digests"])) == 1, t["param_digests"]  # the ranks stay identical replicas
    assert math.isfinite(t["final/loss"]) and t["final/loss"] == pytest.approx(d["final/loss"], rel=REL_TOLERANCE)


@pytest.mark.skipif(cuda_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_without_buffer_broadcast_evaluate_what_the_checkpoint_holds(out):
    args = [*(a for a in CIFAR if a != "train.eval=false"), "recipe.data.train_size=10240", "train.epochs=1",
            "train.ddp.broadcast_buffers=false"]  # 40 steps of 2 x 128: one epoch, then one evaluation
    two = launch(args, out, nproc=2, timeout=300)
    assert two.returncode == 0, two.stderr[-4000:]
    trained = two.results()
    alone = launch([*args, f"run_dir={two.run_dir}", "train.eval_only=true"], out, timeout=300)
    assert alone.returncode == 0, alone.stderr[-4000:]
    evaluated = json.loads((two.run_dir / "eval.json").read_text())
    # The same weights and running statistics; only the evaluation batches' split differs (bf16
    # kernels). tests/test_ddp_settings.py tells rank 0's statistics from a rank's own exactly, on
    # CPU; here rank 0's reach the other rank over NCCL before a graphed run's evaluation.
    assert evaluated["final/eval_loss"] == pytest.approx(trained["final/eval_loss"], rel=1e-3)
