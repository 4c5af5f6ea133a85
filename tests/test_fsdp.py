"""FSDP2 models in graphing's own-loop tools, on the CPU (a gloo process group of one, in process):
``micro_batches`` turns FSDP2's gradient sync off for all but the last micro-batch and the
accumulated gradient is the whole batch's; GraphedStep takes a user's ``fully_shard`` model as it
is (no DDP around it). The graphed step itself is tests/test_fsdp_graphed_step_gpu.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphing

@pytest.fixture
def one_rank_group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_mlp(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.fast
def test_micro_batches_turn_fsdp2_gradient_sync_off_but_for_the_last_and_sum_the_whole_batch(one_rank_group):
    x, y = torch.randn(12, 8), torch.randn(12, 1)
    whole = sharded_mlp()
    F.mse_loss(whole(x), y).backward()
    accumulated = sharded_mlp()
    synced = []
    original = type(accumulated).set_requires_gradient_sync

    def spy(self, value, **kw):
        if self is accumulated:
            synced.append(value)
        return original(self, value, **kw)

    type(accumulated).set_requires_gradient_sync = spy
    try:
        for xm, ym in graphing.micro_batches(accumulated, 3, x, y):
            (F.mse_loss(accumulated(xm), ym) / 3).backward()
    finally:
        type(accumulated).set_requires_gradient_sync = original
    assert synced == [False, True, False, True]  # off for micro-batches 1 and 2, on again for the last
    for a, b in zip(whole.parameters(), accumulated.parameters()):
        torch.testing.assert_close(b.grad.full_tensor(), a.grad.full_tensor(), rtol=1e-5, atol=1e-6)


@pytest.mark.fast
def test_graphed_step_takes_a_fully_shard_model_as_it_is(one_rank_group):
    model = sharded_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def train_step(module, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(module(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    step = graphing.GraphedStep(train_step, model, optimizer, mode="eager")
    assert step.model is model  # FSDP2 communicates itself: no DistributedDataParallel around it
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    losses = [step(x, y).item() for _ in range(5)]
    assert losses[-1] < losses[0]
    step.close()


# Not fast: inductor compiles on a cold cache in about 20 s.
def test_compile_under_fsdp2_compiles_each_innermost_unit_and_leaves_its_hooks_eager(one_rank_group, monkeypatch):
    """graph.compile_model with a sharded model (graphing/full.py compile_sharded_units): the innermost
    FSDP2 units' forwards are compiled, the root's is not, and the sharded model computes and
    reduces its gradients as the uncompiled one does."""
    from graphing.full import compile_sharded_units

    # Inductor's CPU build imports setuptools, whose distutils shim refuses to load once an earlier test in
    # this process imported the standard library's distutils: keep the standard one.
    monkeypatch.setenv("SETUPTOOLS_USE_DISTUTILS", "stdlib")
    torch._dynamo.reset()
    x, y = torch.randn(12, 8), torch.randn(12, 1)
    plain, compiled = sharded_mlp(), sharded_mlp()
    compile_sharded_units(compiled, "default")
    assert hasattr(compiled[0].forward, "_torchdynamo_orig_callable")
    assert not hasattr(compiled.forward, "_torchdynamo_orig_callable") and compiled[2].forward.__self__ is compiled[2]
    for model in (plain, compiled):
        F.mse_loss(model(x), y).backward()
    for a, b in zip(plain.parameters(), compiled.parameters()):
        assert type(b.grad).__name__ == "DTensor"  # FSDP2's post-backward hooks ran around the compiled forward
        torch.testing.assert_close(b.grad.full_tensor(), a.grad.full_tensor(), rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.fast
def test_a_capture_starts_from_shards_even_after_an_evaluation_left_units_gathered(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from graphing.full import reshard_units

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    with torch.no_grad():  # an evaluation: no backward reshards the units afterwards
        model(torch.randn(4, 8))
    # Gathered, FSDP2 registers plain tensors; its next unshard would be a no-op, so a capture now would record
    # no all-gather for them (graphing/full.py reshard_units).
    assert not isinstance(model[0].weight, DTensor) and not isinstance(model[2].weight, DTensor)
    reshard_units(model)
    assert isinstance(model[0].weight, DTensor) and isinstance(model[2].weight, DTensor)
    reshard_units(model)  # already sharded: nothing to do
    reshard_units(torch.nn.Linear(2, 2))  # not sharded at all
    reshard_units(None)
    assert isinstance(model[0].weight, DTensor)
