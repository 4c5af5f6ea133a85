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


class TinyLM(torch.nn.Module):
    """Token embedding, two blocks, final norm and head, the head tied to the embedding or not."""

    def __init__(self, tied: bool = False):
        super().__init__()
        from helpers.one_rank import Block

        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(2))
        self.norm, self.head = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train_tiny_lm(root: str, steps: int = 3):
    from torch.distributed.tensor import DTensor

    from trainer.parallel.sharding import shard_model

    torch.manual_seed(0)
    model = TinyLM()
    shard_model(model, model.blocks, torch.device("cpu"), precision="fp32", reshard_after_forward=True,
                reduce_dtype="fp32", root=root, recipe="tiny")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    losses, held = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        # Between forward and backward: which weights are still gathered (FSDP2 registers plain tensors then).
        held = {name: not isinstance(getattr(model, name).weight, DTensor) for name in ("embed", "norm", "head")}
        held["block"] = not isinstance(model.blocks[0].up.weight, DTensor)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(isinstance(p, DTensor) for p in model.parameters())  # every unit resharded after backward
    return losses, held


@pytest.mark.fast
def test_train_fsdp_root_keeps_the_root_gathered_or_splits_the_embedding_off_and_trains_the_same(one_rank_group):
    resharded, held_resharded = train_tiny_lm("resharded")
    gathered, held_gathered = train_tiny_lm("gathered")
    split, held_split = train_tiny_lm("split")
    assert held_resharded == {"embed": False, "norm": False, "head": False, "block": False}
    assert held_gathered == {"embed": True, "norm": True, "head": True, "block": False}
    assert held_split == {"embed": False, "norm": True, "head": True, "block": False}  # torchtitan's layout
    assert gathered == resharded and split == resharded  # where the weights wait changes no number


@pytest.mark.fast
def test_train_fsdp_root_split_refuses_a_tied_head_and_a_model_without_an_embedding(one_rank_group):
    from trainer.parallel.sharding import shard_model
    from trainer.run.errors import ConfigError

    tied = TinyLM(tied=True)
    with pytest.raises(ConfigError, match=r"train.fsdp.root=split: recipe 'tiny' ties its embedding's weight to "
                                          r"head .*set train.fsdp.root=gathered"):
        shard_model(tied, tied.blocks, torch.device("cpu"), precision="fp32", reshard_after_forward=True,
                    reduce_dtype="fp32", root="split", recipe="tiny")
    from helpers.one_rank import Net

    net = Net(width=8, depth=2)
    with pytest.raises(ConfigError, match="has no nn.Embedding outside its blocks"):
        shard_model(net, net.blocks, torch.device("cpu"), precision="fp32", reshard_after_forward=True,
                    reduce_dtype="fp32", root="split", recipe="tiny")
