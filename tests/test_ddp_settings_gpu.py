"""``train.ddp`` on GPUs over NCCL: DDP's bucket size, bf16 gradient all-reduce and static
graph are captured in the whole-step graph and train as the defaults do.

Runs under torchrun on every GPU of the machine, up to two (one rank still builds DDP and its
NCCL all-reduce). ``pytest -m gpu tests/test_ddp_settings_gpu.py``; skipped without CUDA.
"""
from __future__ import annotations

import math

import pytest

from conftest import cuda_count, launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]

CIFAR = ["recipe=cifar10_resnet18", "recipe.data.source=synthetic", "recipe.data.train_size=8192",
         "recipe.data.test_size=512", "recipe.data.batch_size=128", "train.max_steps=40", "train.log_every=10",
         "train.eval=false", "logger=none", "train.progress=false", "graph=full"]
# bf16 rounds each rank's gradient before the sum: the loss drifts from fp32's by that rounding.
REL_TOLERANCE = 2e-2


@pytest.mark.parametrize("settings", [["train.ddp.grad_reduce=bf16", "train.ddp.bucket_cap_mb=2"],
                                      ["train.ddp.static_graph=true"]], ids=["bf16-buckets-2mb", "static-graph"])
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
