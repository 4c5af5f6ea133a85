"""Adam and AdamW under fsdp2 step on the local shards (trainer/parallel/shard_optimizer.py), bit for bit as torch's
own step on the DTensors: on 2 gloo ranks, with param groups, weight decay, a tensor lr written in place,
clipping to the global norm and a rank whose shard of a parameter is empty; the state stays DTensors.
A resume at another world size through such a state is tests/test_fsdp_training.py's.
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers.launches import launch

OPTIONS = {"default": {}, "fused": {"fused": True}, "float_lr_foreach": {"foreach": True, "float_lr": True}}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard_optimizer")
    run = launch([str(root), json.dumps(list(OPTIONS.values()))], None, script="tests/helpers/shard_optimizer_ranks.py",
                 nproc=2, timeout=180)
    assert run.returncode == 0, run.output[-3000:]
    return {path.stem: json.loads(path.read_text()) for path in root.glob("rank*.json")}


@pytest.mark.parametrize("name", OPTIONS)
def test_adamw_on_local_shards_steps_bit_for_bit_as_on_dtensors(ranks, name):
    suffix = "_".join(sorted(OPTIONS[name])) or "default"
    for rank in (0, 1):
        r = ranks[f"rank{rank}_of2_{suffix}"]
        assert r["equal_after_step"] == [True] * 5, r  # weights and every state tensor, after each step
        assert r["clipped"] and r["moved"] and r["grads_kept"], r
        assert r["class"] == "AdamWOnLocalShards" and r["isinstance_adamw"]
        # What checkpoints see is what torch keeps: DTensor moments, a plain step count, the same keys.
        assert r["state_keys_alike"]
        assert [t for t in r["state_types"] if t.startswith("exp_avg")] == ["exp_avg:DTensor", "exp_avg_sq:DTensor"]
    assert ranks["rank1_of2_default"]["empty_shard"]  # a one-row parameter: rank 1 holds none of it


@pytest.mark.parametrize("name", OPTIONS)
def test_a_step_hook_on_the_optimizer_fires_once_a_step_and_sees_the_dtensors(ranks, name):
    # torch wraps AdamW.step to run the hooks once any AdamW exists (the rank built a plain one first); the local
    # shards' step runs AdamW's own step inside its own, and the hooks must not run again there, over the shards.
    suffix = "_".join(sorted(OPTIONS[name])) or "default"
    steps = len(ranks[f"rank0_of2_{suffix}"]["equal_after_step"])
    for rank in (0, 1):
        saw = ranks[f"rank{rank}_of2_{suffix}"]["hooks_saw"]
        assert {kind: len(calls) for kind, calls in saw.items()} == dict.fromkeys(saw, steps), saw
        first_pre, *later_pre = saw["pre"]
        assert first_pre == {"params": ["DTensor"], "state": []}, saw  # no state before the first step
        assert all(seen == {"params": ["DTensor"], "state": ["DTensor"]} for seen in later_pre + saw["post"]), saw
        assert saw["global_pre"] == saw["pre"] and saw["global_post"] == saw["post"]


@pytest.mark.fast
def test_only_elementwise_optimizers_step_on_local_shards_and_plain_parameters_step_as_before():
    from trainer.parallel.shard_optimizer import on_local_shards

    assert on_local_shards(torch.optim.SGD) is torch.optim.SGD  # not in the list: today's path
    assert on_local_shards(torch.optim.Adam) is on_local_shards(torch.optim.Adam)  # one class each
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    opts = [torch.optim.Adam(a.parameters(), lr=0.1), on_local_shards(torch.optim.Adam)(b.parameters(), lr=0.1)]
    hooks = []  # torch wrapped Adam.step for hooks when the first Adam was built: they still run once a step
    opts[1].register_step_pre_hook(lambda *_: hooks.append("pre"))
    opts[1].register_step_post_hook(lambda *_: hooks.append("post"))
    for _ in range(3):
        for net, opt in zip((a, b), opts):
            opt.zero_grad()
            net(torch.ones(4, 3)).square().sum().backward()
            opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert all(p.grad is not None for p in b.parameters())  # a plain parameter keeps its gradient
    assert hooks == ["pre", "post"] * 3
    with pytest.raises(ValueError, match="takes no closure"):
        opts[1].step(lambda: 0.0)
