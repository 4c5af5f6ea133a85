"""The own-loop toolbox in graphing/: device-side running means and gradient accumulation.

On the CPU: the means equal the plain Python computation, and micro-batches with ``no_sync``
under two real gloo ranks (DDP) give the gradient of the one big batch. On a GPU: the means
accumulate inside a captured graph, on every replay.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import random
import statistics

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphing import RunningMeans, micro_batches, no_sync_except_last


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


@pytest.mark.fast
def test_micro_batches_of_a_plain_module_give_the_whole_batch_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    x, y = torch.randn(12, 6), torch.randn(12, 1)

    seen = []
    for x_micro, y_micro in micro_batches(model, 3, x, y):
        seen.append((x_micro, y_micro))
        (F.mse_loss(model(x_micro), y_micro) / 3).backward()  # 1/3: the mean over the whole batch
    F.mse_loss(reference(x), y).backward()

    assert [tuple(a.shape) for a, _ in seen] == [(4, 6)] * 3
    assert torch.equal(torch.cat([a for a, _ in seen]), x) and torch.equal(torch.cat([b for _, b in seen]), y)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="a batch of 12 does not split into 5 equal micro-batches"):
        micro_batches(model, 5, x, y)


@pytest.mark.fast
def test_no_sync_is_active_while_all_but_the_last_micro_batch_runs():
    class RecordsNoSync(nn.Linear):  # stands in for DDP: only the no_sync protocol matters here
        syncing = True

        @contextlib.contextmanager
        def no_sync(self):
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True

    model = RecordsNoSync(2, 2)
    states = [model.syncing for _ in no_sync_except_last(model, ["a", "b", "c"])]
    assert states == [False, False, True]
    assert model.syncing
    assert [model.syncing for _ in micro_batches(model, 1, torch.zeros(4, 2))] == [True]  # one: a plain step


def _accumulate_under_ddp(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """One gloo rank: two micro-batches through micro_batches on DDP, and a reference on the whole batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)  # a plain module on the job's whole batch
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(1)
    x_all, y_all = torch.randn(8 * world_size, 6, generator=gen), torch.randn(8 * world_size, 1, generator=gen)
    x, y = x_all[8 * rank:8 * (rank + 1)], y_all[8 * rank:8 * (rank + 1)]  # this rank's shard

    after_first = None
    for i, (x_micro, y_micro) in enumerate(micro_batches(ddp, 2, x, y)):
        (F.mse_loss(ddp(x_micro), y_micro) / 2).backward()
        if i == 0:
            after_first = [p.grad.clone() for p in model.parameters()]
    F.mse_loss(reference(x_all), y_all).backward()

    metrics = RunningMeans(["value"], "cpu")
    metrics.add(value=float(rank + 1))
    metrics.add(value=torch.tensor(10.0 * rank))
    torch.save({"after_first": after_first, "grads": [p.grad for p in model.parameters()],
                "whole_batch": [p.grad for p in reference.parameters()],
                "job_mean": metrics.read_and_reset(all_ranks=True)["value"]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    # Free DDP's reducer while the group is up, then meet: a rank that tears gloo down while its peer's
    # reducer still holds the group aborts ("terminate called without an active exception").
    del ddp
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def test_two_gloo_ranks_accumulating_with_no_sync_get_the_whole_batch_gradient(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_accumulate_under_ddp, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    # After the first micro-batch each rank holds only its own gradient: no all-reduce ran (no_sync).
    assert not all(torch.allclose(a, b) for a, b in zip(ranks[0]["after_first"], ranks[1]["after_first"]))
    # After the last: the same gradient on both ranks, that of the one big batch of 16 samples.
    for rank in ranks:
        for got, expected in zip(rank["grads"], rank["whole_batch"]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    # Rank 0 added 1 and 0, rank 1 added 2 and 10: every rank reads the job's mean.
    assert ranks[0]["job_mean"] == ranks[1]["job_mean"] == pytest.approx(13 / 4)


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
