"""The step watchdog's CUDA path (trainer/run/watchdog.py): a GPU that stops answering inside a graphed step ends
the run with exit 8, naming the rank and the step, and leaves no process behind.

One rank under torchrun (the watchdog runs whatever the world size): after step 40, well past warm-up and capture,
the rank queues a kernel that spins for minutes on its stream (tests/helpers/fault_injection.py GPU_HANG_AT_STEP).
Its Python stays free, so this is the watchdog's own event query at work, not its guard. Run on the GPU machine:
``pytest -m gpu tests/test_stall_gpu.py``. Skipped without CUDA.
"""
from __future__ import annotations

import pytest

from helpers.availability import cuda_count
from test_stall import STALL_S, assert_ended_by_the_watchdog, launch_with_fault

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("graph", ["full", "full_compiled"])
def test_a_gpu_that_stops_answering_ends_the_run_with_exit_8_naming_rank_and_step(tmp_path, graph):
    from helpers.fault_injection import GPU_HANG_AT_STEP_ENV

    args = ["recipe=mnist", "recipe.data.source=synthetic", "train.epochs=1000", "train.max_steps=100000",
            "train.eval=false", "checkpoint.save=false", "logger=none", "train.progress=false", "train.log_every=10",
            f"graph={graph}", f"train.stall_timeout_s={STALL_S}"]
    done, took = launch_with_fault(args, tmp_path, {GPU_HANG_AT_STEP_ENV: "40:0"}, nproc=1, timeout=240)
    assert "the GPU spins from step 40" in done.output, done.output[-4000:]
    assert_ended_by_the_watchdog(done, "a training step")
    assert took < 180, f"the run took {took:.0f} s to end after a {STALL_S} s stall timeout"
    assert not done.left, done.left
