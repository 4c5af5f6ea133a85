"""The loaders: any map-style Dataset through DataLoader workers, sharded per rank, the
same batches as the device loader, resumed at the exact batch, evaluation padded and
masked so every sample counts once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List, Optional

import pytest
import torch
from omegaconf import OmegaConf

from helpers.launches import launch_together
from helpers.paths import ROOT
from helpers.processes import MARK, SESSION, cmdline, is_live, marked_pids, stacks
from trainer.data import DeviceLoader, HostLoader, choose_loader, make_loader
from trainer.run.errors import ConfigError
from trainer.recipe import Split
from trainer.run.runtime import Runtime


class Points(torch.utils.data.Dataset):
    """A plain dataset (not a Split): item i is (a float tensor, an int label)."""

    def __init__(self, n: int, read_log=None):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, generator=g)
        self.y = torch.randint(0, 5, (n,), generator=g)
        self.read_log = read_log

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.read_log is not None:
            self.read_log.append(i)
        return self.x[i], int(self.y[i])


def runtime(rank: int, world: int) -> Runtime:
    return Runtime(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"), distributed=False,
                   run_dir=Path("."))


def batches(loader, steps=None, first=0):
    """The loader's next steps' batches, from the epoch's step ``first``; a training step's
    micro-batches joined into one batch (a tail step's with its mask)."""
    out = []
    for i in range(first, first + (loader.steps if steps is None else steps)):
        loader.stage()
        shape = loader.shapes.at(i) if loader.shapes is not None else None
        if shape is None:
            out.append({k: v.clone() for k, v in loader.next_batch().items()})
            continue
        parts = [loader.tail_batch(shape, m) if shape.tail else loader.next_batch() for m in range(len(shape.rows))]
        out.append({k: torch.cat([p[k] for p in parts]).clone() for k in parts[0]})
    return out


def real_rows(batch):
    return batch["x"][batch["mask"]] if "mask" in batch else batch["x"]


@pytest.mark.fast
@pytest.mark.parametrize("workers", [0, 2])
def test_host_loader_over_a_dataset_gives_the_device_loaders_batches_on_each_rank(workers):
    data = Points(1000)
    split = Split(data.x, data.y)
    seen = []
    for rank in (0, 1):
        rt = runtime(rank, 2)
        host = HostLoader(data, 32, rt, train=True, seed=7, num_workers=workers)
        device = DeviceLoader(split, 32, rt, train=True, seed=7)
        for epoch in (0, 3):
            host.start_epoch(epoch)
            device.start_epoch(epoch)
            got, want = batches(host), batches(device)
            assert len(got) == 1000 // 2 // 32 + 1  # 15 full steps and the tail: 1000 - 15 * 64 = 40 samples
            for a, b in zip(got, want):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            assert got[-1]["x"].shape[0] == 20 and got[-1]["mask"].all()  # 20 real samples on each rank
            if epoch == 0:
                seen.append(torch.cat([real_rows(b) for b in got]))
    ours, theirs = seen
    assert not (ours[:, None, :] == theirs[None, :, :]).all(-1).any()  # the ranks' shards are disjoint


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["host", "device"])
@pytest.mark.parametrize("n,world,batch,accum,tail_rows", [
    (1001, 3, 16, 1, (14,)),  # 1001 - 20 * 48 = 41 left: 14 rows on each rank, one of them padded
    (1000, 2, 16, 4, (16, 16, 16, 4)),  # 1000 - 7 * 128 = 104 left: 52 rows per rank, micro-batches of at most 16
    (960, 2, 16, 1, None),  # 30 full steps, nothing left
])
def test_every_training_sample_is_trained_once_per_epoch_with_the_tail_padded_alike_on_every_rank(
        kind, n, world, batch, accum, tail_rows):
    data = Points(n)
    counted = torch.zeros(n, dtype=torch.long)
    lookup = {tuple(row.tolist()): i for i, row in enumerate(data.x)}
    for rank in range(world):
        dataset = data if kind == "host" else Split(data.x, data.y)
        loader = make_loader(dataset, batch, runtime(rank, world), kind=kind, train=True, seed=0,
                             batches_per_step=accum)
        assert (loader.shapes.tail.rows if loader.shapes.tail else None) == tail_rows
        loader.start_epoch(1)
        got = batches(loader)
        if tail_rows:
            assert got[-1]["x"].shape[0] == sum(tail_rows) and loader.shapes.tail.real == n % (batch * accum * world)
        for b in got:
            for row in real_rows(b):
                counted[lookup[tuple(row.tolist())]] += 1
    assert counted.eq(1).all()


@pytest.mark.fast
def test_drop_last_drops_the_tail():
    loader = make_loader(Points(1000), 32, runtime(0, 2), kind="device", train=True, seed=0, drop_last=True)
    assert loader.shapes.tail is None and loader.steps == 15


class EpochPoints(Points):
    """Points whose items change with the epoch (as random crops drawn per epoch do): x + 1000 * epoch."""

    epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 1000 * self.epoch, y


@pytest.mark.fast
def test_the_workers_read_on_into_the_next_epoch_and_its_batches_are_that_epochs():
    """At an epoch's end the training loader's workers are already reading the next epoch's first batches (no
    restart, no empty pipeline at each boundary), each drawn with its own epoch; a jump elsewhere restarts them."""
    data = EpochPoints(200)
    host = HostLoader(data, 16, runtime(0, 1), train=True, seed=4, num_workers=2)

    def expected(epoch):
        fresh = HostLoader(data, 16, runtime(0, 1), train=True, seed=4)  # no workers: read in this process
        fresh.start_epoch(epoch)
        return batches(fresh)

    host.start_epoch(0)
    first = batches(host)
    workers = host._it
    for epoch in (1, 2):
        host.start_epoch(epoch)
        got = batches(host)
        assert host._it is workers  # the same iterator: it read on across the boundary
        want = expected(epoch)
        assert len(got) == len(want) == 200 // 16 + 1
        assert all(torch.equal(a["x"], b["x"]) and a.keys() == b.keys() for a, b in zip(got, want))
        assert (got[0]["x"] - 1000 * epoch).abs().max() < 10  # drawn with its own epoch, not the loop's
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(first, expected(0)))
    host.start_epoch(5)  # not where the workers are: they start over there
    assert host._it is None
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(batches(host), expected(5)))
    host.close()


@pytest.mark.fast
def test_a_host_loader_dropped_without_close_ends_its_workers_at_once():
    """A loader nobody closes (a user's own loop, a test) is freed when its last reference goes, not by the garbage
    collector later: its sampler refers to no loader, so no cycle holds it. In such a cycle the collector's order of
    teardown left DataLoader's shutdown waiting 5 s on each worker (10 s for this loader)."""
    import gc
    import weakref

    host = HostLoader(Points(200), 16, runtime(0, 1), train=True, seed=4, num_workers=2)
    host.start_epoch(0)
    batches(host)
    pids = [w.pid for w in host.loader._iterator._workers]
    freed = weakref.ref(host)
    gc.disable()  # only reference counting may free it
    try:
        began = time.monotonic()
        del host
        assert freed() is None, "a reference cycle keeps the loader (and its workers) until the next collection"
        assert time.monotonic() - began < 3
    finally:
        gc.enable()
    deadline = time.monotonic() + 5
    while any(is_live(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(is_live(pid) for pid in pids), pids


@pytest.mark.fast
def test_resuming_mid_epoch_continues_at_the_exact_batch_without_reading_the_skipped_ones():
    log = []
    data = Points(640, read_log=log)
    rt = runtime(0, 1)
    whole = HostLoader(data, 16, rt, train=True, seed=3)
    whole.start_epoch(2)
    expected = batches(whole)[5:]
    resumed = HostLoader(data, 16, rt, train=True, seed=3)
    resumed.start_epoch(2)
    resumed.skip(5)
    log.clear()
    got = batches(resumed, len(expected), first=5)
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, expected))
    assert len(log) == len(expected) * 16  # nothing before the resumed batch was read


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["host", "device"])
def test_evaluation_pads_and_masks_so_every_sample_counts_once(kind):
    data = Points(1001)
    counted = torch.zeros(1001, dtype=torch.long)
    lookup = {tuple(row.tolist()): i for i, row in enumerate(data.x)}
    for rank in (0, 1, 2):
        dataset = data if kind == "host" else Split(data.x, data.y)
        loader = make_loader(dataset, 64, runtime(rank, 3), kind=kind, train=False, seed=0)
        loader.start_epoch(0)
        for b in batches(loader):
            for row in b["x"][b["mask"]]:
                counted[lookup[tuple(row.tolist())]] += 1
    assert counted.eq(1).all()


@pytest.mark.fast
def test_auto_keeps_small_data_on_the_device_and_device_refuses_data_that_does_not_fit():
    small = Points(100)
    assert choose_loader("auto", small, small, torch.device("cpu")) == "device"

    class Huge(Points):
        def __len__(self):
            return 10**13

    huge = Huge(10)
    assert choose_loader("auto", huge, small, torch.device("cpu")) == "host"
    with pytest.raises(ConfigError, match="recipe.data.loader=host"):
        choose_loader("device", huge, small, torch.device("cpu"))


@pytest.mark.fast
def test_samples_of_different_shapes_are_named():
    class Ragged(Points):
        def __getitem__(self, i):
            return torch.zeros(3 + i % 2), 0

    loader = HostLoader(Ragged(64), 8, runtime(0, 1), train=True, seed=0)
    with pytest.raises(ConfigError, match="every sample of one shape"):
        loader.stage()


class MaskedPoints(Points):
    """Items with a second input: ``{"x", "attention_mask", "y"}``, the mask a function of x (checkable)."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return {"x": x, "attention_mask": x > 0, "y": y}


@pytest.mark.fast
@pytest.mark.parametrize("workers", [0, 2])
def test_both_loaders_carry_a_second_input_beside_x_row_for_row(workers):
    data = MaskedPoints(500)
    rt = runtime(1, 2)
    host = HostLoader(data, 16, rt, train=True, seed=5, num_workers=workers, batches_per_step=2)
    device = make_loader(data, 16, rt, kind="device", train=True, seed=5, batches_per_step=2)  # reads every item
    assert isinstance(device, DeviceLoader)

    def micro_batches(loader):  # as the step reads them: one stage per full step, two micro-batches
        out = []
        for _ in range(loader.shapes.full_steps):
            loader.stage()
            out += [{k: v.clone() for k, v in loader.next_batch().items()} for _ in range(2)]
        return out

    got, want = micro_batches(host), micro_batches(device)
    assert len(got) == 2 * (500 // 2 // 32)
    for a, b in zip(got, want):
        assert set(a) == set(b) == {"x", "attention_mask", "y"}
        assert a["attention_mask"].dtype == torch.bool and a["attention_mask"].shape == (16, 3)
        assert torch.equal(a["attention_mask"], a["x"] > 0)  # each mask row beside its own x row
        assert all(torch.equal(a[k], b[k]) for k in a)
    evaluation = make_loader(data, 64, rt, kind="host", train=False, seed=0)
    assert set(batches(evaluation, 1)[0]) == {"x", "attention_mask", "y", "mask"}  # mask: the padding


@pytest.mark.fast
def test_a_split_with_extra_inputs_is_gathered_on_the_device_with_them():
    data = Points(100)
    split = Split(data.x, data.y, {"attention_mask": data.x > 0})
    assert set(split[3]) == {"x", "attention_mask", "y"}
    loader = DeviceLoader(split, 10, runtime(0, 1), train=False, seed=0)
    b = batches(loader, 1)[0]
    assert torch.equal(b["attention_mask"], b["x"] > 0) and b["mask"].all()


class Items(torch.utils.data.Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return self.item


@pytest.mark.fast
@pytest.mark.parametrize("dataset,named", [
    (Items((torch.zeros(3), torch.ones(3), 1)), "item 0 is a tuple of 3 values"),
    (Items(torch.zeros(3)), "item 0 is a Tensor, not a pair (x, y)"),
    (Items(("images/0.png", 1)), "item 0's 'x' is a builtins.str, not a tensor"),
    (Items({"x": torch.zeros(3), "label": 1}), "item 0 is a dict without 'y' (it has 'x', 'label')"),
    (Items({"x": torch.zeros(3), "y": 1, "mask": torch.ones(3)}), "a field is named 'mask', the trainer's own"),
    (Split(torch.zeros(10, 3), torch.zeros(9)), "the Split has 10 samples in 'x' but 9 in 'y'"),
])
def test_a_dataset_item_that_does_not_fit_the_contract_is_described(dataset, named):
    from trainer.data import item_problem

    assert named in item_problem(dataset)


@pytest.mark.fast
@pytest.mark.parametrize("dataset", [Points(4), MaskedPoints(4), Items((torch.zeros(2, 2).numpy(), 3.5)),
                                     Split(torch.zeros(4, 3), torch.zeros(4), {"lengths": torch.ones(4)})])
def test_items_that_fit_the_contract_pass(dataset):
    from trainer.data import item_problem

    assert item_problem(dataset) is None


RECIPE = '''
"""A recipe whose data is a plain map-style Dataset, not tensors."""
import torch
import torch.nn.functional as F

from trainer.recipe import Datasets, Recipe


class Blobs(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 8, generator=g) + 5 * F.one_hot(self.y, 8).float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def build(cfg, runtime):
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def criterion(output, target):  # per sample, without a reduction keyword: training takes the mean
        return F.cross_entropy(output.float(), target, reduction="none")

    return Recipe(name="blobs", model=model, data=Datasets(Blobs(2048, 1), Blobs(333, 2), "blobs"),
                  preprocess=lambda batch, train: batch, criterion=criterion,
                  correct=lambda output, target: output.argmax(-1) == target)
'''


@pytest.mark.fast
def test_null_workers_are_this_ranks_share_of_the_cores_less_one(monkeypatch):
    from conf.schema import compose
    from trainer.data.workers import loader_workers
    from trainer.plan import plan_run

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert loader_workers(None) == min(32, cores - 1)
    assert loader_workers(3) == 3 and loader_workers(0) == 0  # a number as given
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert loader_workers(None) == 0  # a core per rank: the rank reads itself
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = compose(["recipe=torchvision_classifier"])
    assert cfg.recipe.data.num_workers is None  # the image recipe's default: the machine's cores
    assert plan_run(cfg, torch.device("cpu"), 1).num_workers == min(32, cores - 1)
    assert plan_run(compose(["recipe=mnist"]), torch.device("cpu"), 1).num_workers == 0  # the default elsewhere


def shared_fields(batch):
    """A DataLoader collate_fn run in the worker: whether each field of BatchReader's batch is in shared memory."""
    return {name: values.is_shared() for name, values in batch.items()}


def test_a_worker_stacks_its_batch_in_shared_memory_so_sending_it_copies_nothing():
    """A batch stacked into ordinary memory is copied again into shared memory when the worker sends it; stacked
    there to begin with (as torch's default_collate does), it goes as it is. In this process: ordinary memory."""
    from trainer.data.items import BatchReader

    reader = BatchReader(Points(32))
    loader = torch.utils.data.DataLoader(reader, batch_sampler=[list(range(8)), list(range(8, 16))], num_workers=1,
                                         collate_fn=shared_fields, multiprocessing_context="fork")
    assert [flags["x"] for flags in loader] == [True, True]
    batch = reader.__getitems__(list(range(8)))
    assert not batch["x"].is_shared() and torch.equal(batch["x"], Points(32).x[:8])


class SlowPoints(Points):
    """Points that take ``delay_s`` each to read: an input slower than the step."""

    def __init__(self, n: int, delay_s: float):
        super().__init__(n)
        self.delay_s = delay_s

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return super().__getitem__(i)


@pytest.mark.fast
def test_the_loops_wait_for_its_input_is_counted_and_the_device_loader_never_waits():
    """HostLoader.waited_s (results.json's time/input_wait_s over the training loop): the seconds stage() waited
    for a batch; with the reads in this process (no workers) that is every read."""
    host = HostLoader(SlowPoints(64, 0.01), 4, runtime(0, 1), train=True, seed=0, num_workers=0)
    host.start_epoch(0)
    for _ in range(3):
        host.stage()
    assert 3 * 4 * 0.01 <= host.waited_s < 5, host.waited_s
    host.close()
    device = DeviceLoader(Split(torch.randn(64, 3), torch.zeros(64, dtype=torch.long)), 4, runtime(0, 1),
                          train=True, seed=0)
    device.start_epoch(0)
    device.stage()
    assert device.waited_s == 0.0


def test_a_dataset_recipe_trains_under_two_gloo_ranks_alike_on_both_loaders(tmp_path, out):
    package = tmp_path / "site" / "user_data"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "blobs.py").write_text(textwrap.dedent(RECIPE))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(package.parent), os.environ.get("PYTHONPATH")) if p)}
    args = ["recipe._target_=user_data.blobs.build", "recipe.name=blobs", "recipe.data.batch_size=32",
            "recipe.data.eval_batch_size=50", "train.epochs=2", "train.log_every=8", "logger=none", "graph=eager"]
    runs = launch_together({kind: [*args, f"recipe.data.loader={kind}", "recipe.data.num_workers=2"]
                            for kind in ("host", "device")}, out, nproc=2, env=env, timeout=240)
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    host, device = runs["host"].results(), runs["device"].results()
    assert host["param_digests"] == device["param_digests"] and len(set(host["param_digests"])) == 1
    assert host["final/eval_samples"] == 333  # padded batches, masked: each sample once
    assert host["final/eval_accuracy"] > 0.9
    assert 0 <= host["time/input_wait_s"] < host["train_loop_s"] and device["time/input_wait_s"] == 0
    # inside the headline phase's wall window: part of the whole loop's wait (which also counts warm-up's batches)
    assert 0 <= host["perf/wall_input_wait_s"] <= host["time/input_wait_s"] and host["timed_phase"] == "eager"
    assert host["perf/wall_input_wait_s"] < host["perf/wall_s"] and device["perf/wall_input_wait_s"] == 0


def test_a_host_loader_with_workers_exits_when_training_ends(debug_run_with_host_workers_and_a_broken_wandb):
    """Its workers inherit the blocked stop signals of train.py: they must still be shut down."""
    done = debug_run_with_host_workers_and_a_broken_wandb  # launched with a 90 s timeout: a hang fails it
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done:" in done.stdout
    assert OmegaConf.load(done.run_dir / "config.yaml").recipe.data.loader_used == "host"


A_RANK_WITH_WORKERS = '''
import os, sys, time
import torch
sys.path.insert(0, os.getcwd())
from trainer.data import HostLoader
from trainer.data.workers import WorkerSettings, use_worker_settings
from trainer.recipe import Split
from trainer.run.runtime import Runtime


class StuckAfter(torch.utils.data.Dataset):
    """Items 0..63; a worker that has read ``items`` of them never ends reading the next (stuck on a lock, say)."""

    def __init__(self, items):
        self.items, self.read = items, 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None:  # a worker (the rank reads item 0 for its shape)
            self.read += 1  # in this worker's own copy
        while self.read > self.items:
            time.sleep(1)
        return torch.tensor([float(i)]), 0


if __name__ == "__main__":
    start, then = sys.argv[1], sys.argv[2]  # then: wait (to be killed) or exit (its loader still referenced)
    use_worker_settings(WorkerSettings(start))
    rt = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False, run_dir=None)
    loader = HostLoader(StuckAfter(64 if then == "wait" else 16), 8, rt, train=True, seed=0, num_workers=2)
    seen = []
    for _ in range(3):
        loader.stage()
        seen += loader.next_batch()["x"].view(-1).tolist()
    assert len(set(seen)) == 24 and set(seen) <= set(range(64)), seen
    print(" ".join(str(w.pid) for w in loader.loader._iterator._workers), flush=True)
    if then == "wait":
        time.sleep(60)
    sys.exit(0)  # each worker has read its 16 items and is stuck on the next; the loader is never closed
'''


def start_method(name: str):
    return pytest.param(name, marks=pytest.mark.skipif(
        name not in __import__("multiprocessing").get_all_start_methods(), reason=f"no {name} here"))


def start_a_rank_with_workers(tmp_path, start: str, then: str):
    """A process marked for the test (``marked_pids`` finds it and whatever it starts: workers, a forkserver,
    a resource tracker) that reads 3 batches through a HostLoader with 2 workers started by ``start``, prints
    their pids, then waits or exits."""
    script = tmp_path / "rank.py"
    script.write_text(A_RANK_WITH_WORKERS)
    mark = f"{SESSION}-workers-{tmp_path.name}"
    rank = subprocess.Popen([sys.executable, str(script), start, then], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", MARK: mark})
    return rank, mark


def left_alive(mark: str, seconds: float) -> List[str]:
    """The processes carrying ``mark`` still alive ``seconds`` from now (sooner when none is), killed then."""
    deadline = time.monotonic() + seconds
    while marked_pids(mark) and time.monotonic() < deadline:  # a zombie counts as gone
        time.sleep(0.05)
    left = marked_pids(mark)
    named = [cmdline(pid) for pid in left]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return named


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start", [start_method(m) for m in ("fork", "spawn", "forkserver")])
def test_host_loader_workers_die_with_their_rank_however_they_were_started(tmp_path, start):
    """A worker forked from its rank holds copies of its sockets (gloo's): alive after its rank is killed, it keeps
    the other ranks' connections to the dead one open. A forkserver's or spawn's worker is not the rank's child:
    neither the parent-death signal nor DataLoader's watchdog (which watches the worker's parent) sees the rank
    die, and workers block SIGTERM. Each must go with its rank, and the forkserver too."""
    rank, mark = start_a_rank_with_workers(tmp_path, start, "wait")
    try:
        workers = [int(pid) for pid in rank.stdout.readline().split()]
        assert len(workers) == 2, workers
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 2.0
    while any(is_live(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [pid for pid in workers if is_live(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{start} workers {left} outlived their rank by 2 s"
    assert not (left := left_alive(mark, 5.0)), f"processes the rank started outlived it by 5 s: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start", [start_method(m) for m in ("fork", "forkserver")])
def test_a_rank_that_exits_with_stuck_workers_and_its_loader_referenced_still_ends(tmp_path, start):
    """multiprocessing's exit handler terminates the workers still alive and joins them: with SIGTERM blocked in
    workers it once waited forever. A SIGTERM from the rank itself ends a worker, so the process ends."""
    rank, mark = start_a_rank_with_workers(tmp_path, start, "exit")
    try:
        assert len(rank.stdout.readline().split()) == 2
        rank.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the rank did not end within 10 s of its exit:\n{stacks([rank.pid])}")
    finally:
        rank.kill()
        rank.wait()
    assert not (left := left_alive(mark, 5.0)), f"processes the rank started outlived it by 5 s: {left}"


class StuckAt(torch.utils.data.Dataset):
    """Items (x, 0); reading item ``stuck`` takes ``seconds``, and first writes the reading worker's pid to
    ``pid_file`` where one is given."""

    def __init__(self, n: int, stuck: int, seconds: float, pid_file: Optional[str] = None):
        self.n, self.stuck, self.seconds, self.pid_file = n, stuck, seconds, pid_file

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.stuck:
            if self.pid_file:
                with open(self.pid_file + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename(self.pid_file + ".tmp", self.pid_file)
            time.sleep(self.seconds)
        return torch.tensor([float(i)]), 0


class FailsAt(torch.utils.data.Dataset):
    """Items (x, 0); reading item ``bad`` raises."""

    def __init__(self, n: int, bad: int):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"item {i} cannot be read")
        return torch.tensor([float(i)]), 0


@pytest.mark.fast
def test_a_failed_whole_read_has_ended_its_workers_when_the_error_reaches_the_caller():
    """The error's traceback holds the reading DataLoader iterator, in a cycle only the garbage collector frees (5 s
    a worker, in DataLoader's shutdown from there): so read_every_item ends its workers itself before the error
    leaves it."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    from trainer.data import read_every_item

    with pytest.raises(ValueError, match="item 40 cannot be read") as failed:
        read_every_item(FailsAt(64, bad=40), num_workers=2, batch=8)
    held, tb = [], failed.value.__traceback__
    while tb is not None:
        held += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, _MultiProcessingDataLoaderIter)]
        tb = tb.tb_next
    assert held, "no reading iterator in the traceback: the test no longer sees what it checks"
    assert all(not worker.is_alive() for it in held for worker in it._workers)


@pytest.fixture
def worker_timeout_of_2_s():
    from trainer.data.workers import WorkerSettings, use_worker_settings

    use_worker_settings(WorkerSettings(timeout_s=2.0))
    yield
    use_worker_settings(WorkerSettings())


def test_a_stuck_reading_worker_ends_the_wait_with_a_message_naming_it(worker_timeout_of_2_s):
    from trainer.data import read_every_item
    from trainer.data.workers import LoaderStuck

    with pytest.raises(LoaderStuck) as stuck:
        read_every_item(StuckAt(64, stuck=40, seconds=600), num_workers=2, batch=8)
    message = str(stuck.value)
    assert "reading StuckAt (64 items, read once)" in message and "sent no batch for 2 s" in message, message
    assert "recipe.data.worker_timeout_s" in message and "recipe.data.num_workers=0" in message, message
    pids = [int(p) for p in message.split("(pids ")[1].split(")")[0].split(", ")]
    assert len(pids) == 2, message
    del stuck  # the loader's iterator goes with the traceback: it shuts its workers down, the stuck one included
    deadline = time.monotonic() + 10
    while any(is_live(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if is_live(pid)], "a worker outlived the error by 10 s"


def test_a_dead_worker_ends_the_wait_within_seconds_not_after_the_whole_timeout(tmp_path):
    """The wait for a batch is sliced (trainer/data/workers.py LIVENESS_CHECK_S): a worker killed from outside while
    the rank waits for its batch is named within a slice, although the run's worker_timeout_s (300 s by default)
    is far longer."""
    import threading

    from trainer.data import read_every_item
    from trainer.data.workers import LIVENESS_CHECK_S, LoaderStuck

    pid_file = tmp_path / "stuck.pid"

    def kill_the_stuck_worker():
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_the_stuck_worker, daemon=True)
    killer.start()
    with pytest.raises(RuntimeError) as died:
        # Item 8 opens the second batch, the second worker's first: it sent nothing before it (a batch of a worker
        # killed before the rank fetched its tensors' shared memory would fail differently).
        read_every_item(StuckAt(64, stuck=8, seconds=600, pid_file=str(pid_file)), num_workers=2, batch=8)
    killed_at = pid_file.stat().st_mtime
    waited = time.time() - killed_at
    killer.join()
    assert not isinstance(died.value, LoaderStuck), died.value
    assert "exited unexpectedly" in str(died.value) and pid_file.read_text() in str(died.value), died.value
    assert waited < 2 * LIVENESS_CHECK_S, f"the rank waited {waited:.1f} s for a dead worker"
