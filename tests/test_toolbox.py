"""The own-loop toolbox in graphing/: device-side running means.

On the CPU: the means equal the plain Python computation. On a GPU: the means accumulate
inside a captured graph, on every replay.
"""
from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from graphing import RunningMeans


@pytest.mark.fast
def test_running_means_equal_the_plain_python_means_interval_after_interval():
    rng = random.Random(0)
    metrics = RunningMeans(["loss", "grad_norm", "never_added"], "cpu")
    buffer = metrics.totals.data_ptr()
    for steps in (5, 1, 12):  # three log intervals
        losses, norms = [], []
        for i in range(steps):
            loss = torch.tensor(rng.uniform(0.5, 4.0), dtype=torch.float32)  # what a step's loss is
            losses.append(loss.item())
            metrics.add(loss=loss)
            if i % 2 == 0:  # a value added on some steps only counts on those
                norm = rng.uniform(0.0, 2.0)  # a Python number works too
                norms.append(norm)
                metrics.add(grad_norm=norm)
        means = metrics.read_and_reset()
        assert means["loss"] == pytest.approx(statistics.fmean(losses), rel=1e-12)
        assert means["grad_norm"] == pytest.approx(statistics.fmean(norms), rel=1e-12)
        assert math.isnan(means["never_added"])
        assert metrics.totals.data_ptr() == buffer  # reset in place: a captured graph keeps adding to it
    assert all(math.isnan(v) for v in metrics.read_and_reset().values())  # nothing since the last read


@pytest.mark.fast
def test_running_means_refuse_what_they_cannot_average():
    metrics = RunningMeans(["loss"], "cpu")
    with pytest.raises(KeyError, match=r"no 'accuracy': it was made with \['loss'\]"):
        metrics.add(accuracy=torch.tensor(0.5))
    with pytest.raises(ValueError, match=r"takes one value, got shape \(4,\): reduce it first"):
        metrics.add(loss=torch.ones(4))
    with pytest.raises(ValueError, match="distinct names"):
        RunningMeans(["loss", "loss"], "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_running_means_add_on_every_replay_of_a_captured_graph():
    metrics = RunningMeans(["x"], "cuda")
    static = torch.zeros((), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # one eager call before capture, as GraphedStep's warm-up does
        metrics.add(x=static * 2)
    torch.cuda.current_stream().wait_stream(side)
    assert metrics.read_and_reset() == {"x": 0.0}

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        metrics.add(x=static * 2)
    assert metrics.read_and_reset() == {"x": pytest.approx(math.nan, nan_ok=True)}  # capture records, adds nothing
    torch.cuda.set_sync_debug_mode("error")  # the loop between reads never waits for the device
    try:
        for value in (1.0, 2.0, 3.0, 4.0):
            static.fill_(value)
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert metrics.read_and_reset() == {"x": pytest.approx(5.0)}  # mean of 2, 4, 6, 8
    static.fill_(7.0)
    graph.replay()
    assert metrics.read_and_reset() == {"x": pytest.approx(14.0)}  # the reset was in place: still the graph's buffer
