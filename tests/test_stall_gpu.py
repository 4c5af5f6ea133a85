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


@pytest.mark.parametrize("guarded", [True, False])
def test_the_watchdogs_event_query_during_a_global_capture_waits_for_the_next_look(guarded):
    """The watchdog's thread queries CUDA events once a second, whatever the loop is doing; under
    capture_error_mode="global" a query from another thread while the loop captures breaks the capture (seen on an
    H200: FSDP2's capture failed at random). The thread skips its look while a capture is under way
    (graphing.outside_capture) and reads the events at the next one. The unguarded row shows the query does break
    such a capture, so the guarded row's pass means something."""
    import threading

    import torch

    from graphing import outside_capture
    from graphing.capture import capture
    from trainer.run.watchdog import StallWatchdog

    watchdog = StallWatchdog(60, 0, torch.device("cuda", 0), guard=False)
    x = torch.randn(1024, device="cuda")
    out = torch.empty_like(x)
    watchdog.step(1, steady=True)  # an event is pending: the thread's next look queries it
    queried = []

    def look():
        if guarded:
            watchdog._collect()
            with outside_capture() as free:
                queried.append(free)
        else:
            try:
                queried.append(watchdog._pending[0][1].query())
            except RuntimeError as err:  # CUDA refuses it, and the capture is broken
                queried.append(type(err).__name__)

    def step():
        out.copy_(x * 2)
        thread = threading.Thread(target=look)
        thread.start()
        thread.join(timeout=10)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph, _, failure = capture(step, stream, None, "global")
    torch.cuda.current_stream().wait_stream(stream)
    if guarded:
        assert failure is None, failure
        assert queried == [False] and len(watchdog._pending) == 1  # the look skipped the query: still pending
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x * 2)
        watchdog._collect()  # the next look, outside the capture, reads the event
        assert not watchdog._pending and watchdog.at_step == 1
    else:
        assert graph is None and "CUDA graph capture failed" in failure, failure
        assert queried and queried[0] is not True, queried
