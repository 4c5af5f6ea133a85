"""A user tunes DDP with train.ddp: the bucket size, bf16 reduction, static_graph and
broadcast_buffers reach the DDP the run builds; two gloo ranks reducing in bf16 train as one
replica, with a loss that differs from fp32 reduction only by bf16's rounding of the gradients;
and two ranks evaluate rank 0's model, whichever way buffers are kept.

The refusals (a bucket that is not a positive size, static_graph with gradient accumulation
under DDP) are in tests/test_bad_input.py; the keys' composition in tests/test_config.py.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from conf.schema import compose
from graphing import GraphOptions, build_executor
from helpers.launches import Finished, free_port, launch_together
from helpers.shared_runs import TWO_RANKS_ON_CIFAR
from trainer.plan import plan_run
from trainer.run.runtime import Runtime
from trainer.trainer import Trainer

QUICK = ["recipe.data.source=synthetic", "recipe.data.train_size=2048", "recipe.data.test_size=256",
         "recipe.data.eval_batch_size=128", "logger=none", "train.progress=false"]


@pytest.fixture
def process_group():
    """A real one-rank gloo process group: executors wrap the model in DDP, as under torchrun."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def bf16_representable(t: torch.Tensor) -> bool:
    return torch.equal(t, t.to(torch.bfloat16).float())


@pytest.mark.fast
def test_the_executor_registers_the_given_comm_hook_on_the_ddp_it_builds(process_group):
    states = []

    def halving_hook(state, bucket):  # the gradients DDP keeps are what the hook's future returns
        states.append(state)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() * 0.5)
        return fut

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x = torch.randn(32, 8)
    expected = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    executor = build_executor(GraphOptions(mode="eager").resolved("cpu", 1, False), torch.device("cpu"),
                              ddp_kwargs={"bucket_cap_mb": 1}, comm_hook=halving_hook)
    wrapped = executor.wrap_model(model)
    assert isinstance(wrapped, DDP) and wrapped.bucket_bytes_cap == 2**20
    wrapped(x).square().mean().backward()
    assert states and set(states) == {None}  # DDP's process group: the default one
    for param, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(param.grad, grad * 0.5)
    executor.close()


def built_run(tmp_path: Path, overrides):
    """The run train.py builds for ``overrides``, in this process, on its one-rank process group."""
    plan = plan_run(compose([*QUICK, f"output_root={tmp_path}", *overrides]), torch.device("cpu"), world_size=1)
    return Trainer(plan, Runtime(rank=0, local_rank=0, world_size=1, device=plan.device, distributed=False,
                                 run_dir=tmp_path))


def gradients(run) -> list:
    torch.manual_seed(0)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    torch.nn.functional.cross_entropy(run.model(x), y).backward()
    return [p.grad.clone() for p in run.raw_model.parameters()]


@pytest.mark.fast
def test_train_ddp_settings_reach_the_ddp_the_run_builds(process_group, tmp_path):
    tuned = built_run(tmp_path, ["train.ddp.bucket_cap_mb=1", "train.ddp.grad_reduce=bf16",
                                 "train.ddp.static_graph=true", "train.ddp.broadcast_buffers=false"])
    default = built_run(tmp_path, [])
    try:
        for run in (tuned, default):
            assert isinstance(run.model, DDP) and run.model.module is run.raw_model
            assert run.model.gradient_as_bucket_view
        assert tuned.model.bucket_bytes_cap == 2**20 and tuned.model.static_graph
        assert default.model.bucket_bytes_cap == 25 * 2**20 and not default.model.static_graph
        assert not tuned.model.broadcast_buffers and default.model.broadcast_buffers  # torch 2.11 and 2.14 alike
        # Reduced through bf16, every gradient element is a bf16 number; reduced in fp32, not.
        assert all(bf16_representable(g) for g in gradients(tuned))
        assert not all(bf16_representable(g) for g in gradients(default))
    finally:
        tuned.close()
        default.close()


@pytest.mark.fast
def test_torchs_default_buckets_stay_unless_a_bucket_size_is_set(process_group, tmp_path):
    """Any bucket_cap_mb passed to DDP also replaces its 1 MiB first bucket, so none is passed by default."""
    def built(overrides):
        plan = plan_run(compose([*QUICK, *overrides]), torch.device("cpu"), world_size=1)
        executor = build_executor(plan.graph, plan.device, **plan.parallelism.executor_arguments)
        torch.manual_seed(0)
        ddp = executor.wrap_model(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]))
        for _ in range(3):  # DDP rebuilds its buckets after the first step, and reports them after that
            ddp(torch.randn(4, 512)).sum().backward()
        return [int(n) for n in ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]

    layer = (512 * 512 + 512) * 4
    assert built([]) == [layer, 3 * layer]  # torch's default: a 1 MiB first bucket, then 25 MiB ones
    assert built(["train.ddp.bucket_cap_mb=25"]) == [4 * layer]
    assert built(["train.ddp.bucket_cap_mb=0.5"]) == [layer] * 4


@pytest.fixture(scope="module")
def tuned_runs(tmp_path_factory, mnist_files):
    """This module's two launches, side by side, two gloo ranks each: the 8-step mnist run of tests/conftest.py
    reducing in bf16 ("bf16"), and its cifar run with BatchNorm's buffers broadcast ("broadcast_buffers")."""
    bf16 = [f"recipe.data.root={mnist_files}", "recipe.data.source=auto", "recipe.data.eval_batch_size=128",
            "train.max_steps=8", "train.log_every=8", "logger=none", "train.ddp.bucket_cap_mb=1",
            "train.ddp.grad_reduce=bf16", "train.ddp.static_graph=true"]
    broadcast = [*TWO_RANKS_ON_CIFAR, "train.ddp.broadcast_buffers=true"]
    return launch_together({"bf16": bf16, "broadcast_buffers": broadcast}, tmp_path_factory.mktemp("ddp_settings"),
                           nproc=2, timeout=240)


def test_two_ranks_reducing_in_bf16_stay_identical_and_lose_only_rounding(tuned_runs, two_ranks_on_mnist_files):
    fp32 = two_ranks_on_mnist_files  # the reference, reduced in fp32: tests/conftest.py's shared 8-step run
    bf16 = tuned_runs["bf16"]
    for done in (fp32, bf16):
        assert done.returncode == 0, done.stderr[-4000:]
    exact, rounded = fp32.results(), bf16.results()
    for results in (exact, rounded):
        assert results["world_size"] == 2 and results["steps"] == 8 and results["data_source"] == "mnist"
        digests = results["param_digests"]
        assert len(digests) == 2 and digests[0] == digests[1]  # DDP kept the replicas identical
        assert math.isfinite(results["final/loss"])
    assert rounded["param_digests"][0] != exact["param_digests"][0]  # the gradients did go through bf16
    # 8 SGD steps from the same weights: the losses differ only by bf16's rounding (~0.4%) of the gradients.
    assert rounded["final/loss"] == pytest.approx(exact["final/loss"], rel=1e-3)
    assert "grad_reduce: bf16" in (bf16.run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("broadcast_buffers", ["true", "false"])
def test_two_ranks_evaluate_the_model_their_checkpoint_holds(tmp_path, broadcast_buffers, train_here, request):
    """BatchNorm's running statistics differ between ranks, with DDP's per-forward broadcast
    (one batch apart) or without it (each rank's own): evaluation takes rank 0's first, so the
    two ranks' evaluation is that of the checkpoint, which holds rank 0's."""
    args = [*TWO_RANKS_ON_CIFAR, f"train.ddp.broadcast_buffers={broadcast_buffers}"]
    # false is this project's default: tests/conftest.py's shared run. Evaluated here in a copy.
    shared = (request.getfixturevalue("tuned_runs")["broadcast_buffers"] if broadcast_buffers == "true"
              else request.getfixturevalue("two_ranks_on_cifar"))
    two = Finished(shared.returncode, shared.stdout, shared.stderr, tmp_path / "outputs")
    shutil.copytree(shared.output_root, two.output_root)
    assert two.returncode == 0, two.stderr[-4000:]
    trained = two.results()
    assert trained["world_size"] == 2 and trained["steps"] == 4  # one epoch of 128 samples, 2 ranks x 16
    assert f"broadcast_buffers: {broadcast_buffers}" in (two.run_dir / "config.yaml").read_text()
    evaluated = train_here([*args, f"run_dir={two.run_dir}", "train.eval_only=true"], tmp_path)  # one process
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    alone = json.loads((two.run_dir / "eval.json").read_text())
    assert alone["final/eval_loss"] == pytest.approx(trained["final/eval_loss"], rel=1e-6, abs=0)
