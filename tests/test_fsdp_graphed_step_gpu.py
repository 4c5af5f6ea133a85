"""GraphedStep with a model the user sharded with FSDP2's ``fully_shard`` (one rank here: a process
group of one): the whole step (forward, loss, backward with FSDP2's all-gathers and reduce-scatters,
clipping on DTensor gradients, AdamW on the DTensor shards) captured as one graph and replayed equal
to eager, with ``reshard_after_forward`` true and false and with gradient accumulation
(``graphing.micro_batches``: FSDP2's gradient sync off for all but the last micro-batch).

Run on the GPU machine: ``pytest -m gpu tests/test_fsdp_graphed_step_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphing
from helpers.one_rank import Net, group_of_one

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 20


@pytest.fixture(scope="module")
def one_rank_group():
    with group_of_one("nccl"):
        yield


def sharded(reshard_after_forward: bool, root_gathered: bool = False) -> torch.nn.Module:
    """Net with each block a unit; the root (the head) resharded as the blocks are, or kept gathered from forward
    to backward (``root_gathered``: train.fsdp.root=gathered's layout)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Net(width=64, depth=3).cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward and not root_gathered, mp_policy=policy)
    return model


def train(mode: str, reshard_after_forward: bool, micro: int, evaluate_before_call: int = -1,
          root_gathered: bool = False):
    model = sharded(reshard_after_forward, root_gathered)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # made capturable by GraphedStep

    def train_step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        for xm, ym in graphing.micro_batches(model, micro, x, y):
            (F.mse_loss(model(xm).float(), ym) / micro).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    step = graphing.GraphedStep(train_step, model, optimizer, mode=mode, capture_error_mode="thread_local")
    g = torch.Generator(device="cuda").manual_seed(1)
    norms = []
    for it in range(STEPS):
        x, y = torch.randn(32, 64, device="cuda", generator=g), torch.randn(32, 1, device="cuda", generator=g)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * (1 - it / STEPS)  # a float written between calls, carried into the graph
        if it == evaluate_before_call:  # a user's evaluation: forward only, no backward to reshard after it
            assert mode == "eager" or step.phase == "capture"
            with torch.no_grad():
                model(x)
        norms.append(step(x, y).clone())
    phase = step.phase
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    step.close()
    return torch.stack(norms), params, phase


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_a_users_fully_shard_model_graphs_whole_step_equal_to_eager(one_rank_group, reshard_after_forward, micro):
    eager_norms, eager_params, eager_phase = train("eager", reshard_after_forward, micro)
    full_norms, full_params, full_phase = train("full", reshard_after_forward, micro)
    assert eager_phase == "eager" and full_phase == "graph"
    torch.testing.assert_close(full_norms, eager_norms, rtol=1e-3, atol=1e-5)  # float32 lr tensor vs floats
    for a, b in zip(eager_params, full_params):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)
    assert not torch.equal(eager_params[0], sharded(reshard_after_forward).blocks[0].norm.weight.full_tensor())


@pytest.mark.parametrize("reshard_after_forward, root_gathered", [(True, False), (False, False), (True, True)],
                         ids=["resharded", "gathered", "root-gathered"])
def test_an_evaluation_right_before_the_capture_leaves_the_graph_equal_to_eager(one_rank_group, reshard_after_forward,
                                                                                root_gathered):
    # Call 11 (0-based) is the capture. The evaluation before it leaves units built with reshard_after_forward=False
    # gathered (every unit, or the root alone: train.fsdp.root=gathered); captured so, the graph would gather
    # nothing and read those weights, frozen, at every replay.
    capture_call = 11
    eager_norms, eager_params, _ = train("eager", reshard_after_forward, 1, evaluate_before_call=capture_call,
                                         root_gathered=root_gathered)
    full_norms, full_params, full_phase = train("full", reshard_after_forward, 1, evaluate_before_call=capture_call,
                                                root_gathered=root_gathered)
    assert full_phase == "graph"
    torch.testing.assert_close(full_norms, eager_norms, rtol=1e-3, atol=1e-5)
    for a, b in zip(eager_params, full_params):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)
