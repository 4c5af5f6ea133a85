"""AdamW on FSDP2's DTensor parameters two ways, on each rank: torch's own step (through DTensor) and
trainer/parallel/shard_optimizer.py's step on the local shards; what tests/test_shard_optimizer.py compares.

    torchrun --nproc_per_node=2 tests/helpers/shard_optimizer_ranks.py OUT_DIR OPTIONS_JSON   # a list of option sets

Both copies of one model (rows that do not split evenly over 2 ranks, a one-row parameter whose second
shard is empty) train the same steps: two param groups (one without weight decay), a tensor lr that a
schedule writes in place (a float with foreach, which takes a tensor only
on CUDA), gradients clipped to a global norm; once per set of AdamW options (``float_lr`` aside).
Writes OUT_DIR/rank<R>_of<W>_<option names>.json: whether
the weights and the optimizer states are bitwise equal after every step, the state's types, the norms, and
what the step hooks registered on the local-shard optimizer saw: the plain AdamW built first has torch wrap
``AdamW.step`` for hooks, as in any process that built one.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.parallel.shard_optimizer import on_local_shards  # noqa: E402

STEPS = 5


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1), torch.nn.Flatten(0))


def optimizer(cls, net: torch.nn.Module, lr: torch.Tensor, options: dict) -> torch.optim.Optimizer:
    decay = [p for p in net.parameters() if p.dim() > 1]
    plain = [p for p in net.parameters() if p.dim() <= 1]
    return cls([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}], lr=lr,
               betas=(0.9, 0.95), **options)


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for options in json.loads(sys.argv[2]):
        compare(out, options)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def compare(out: Path, options: dict) -> None:
    name = "_".join(sorted(options)) or "default"
    tensor_lr = options.pop("float_lr", False) is False  # foreach takes a tensor lr only when capturable (CUDA)
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    nets, optimizers, lrs = [], [], []
    for cls in (torch.optim.AdamW, on_local_shards(torch.optim.AdamW)):
        net = model()
        fully_shard(net, mesh=mesh)
        lr = torch.tensor(1e-2) if tensor_lr else 1e-2
        nets.append(net)
        lrs.append(lr)
        optimizers.append(optimizer(cls, net, lr, options))
    hooks_saw, global_hooks = _watch_step_hooks(optimizers[1])
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batch, as data parallelism has it
    equal_after_step, norms = [], []
    for step in range(STEPS):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, generator=g)
        for net, opt, lr in zip(nets, optimizers, lrs):
            for group in opt.param_groups:  # the schedule writes the tensor the optimizer holds (or a float)
                if tensor_lr:
                    group["lr"].fill_(1e-2 * (1 - step / STEPS))
                else:
                    group["lr"] = 1e-2 * (1 - step / STEPS)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(net(x), y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05).full_tensor()))
            opt.step()
        weights = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(*(n.parameters() for n in nets)))
        states = all(torch.equal(_local(a[k]), _local(b[k])) for a, b in zip(*(o.state.values() for o in optimizers))
                     for k in a)
        equal_after_step.append(weights and states)
    for handle in global_hooks:
        handle.remove()
    local_shard_state = optimizers[1].state
    result = {
        "equal_after_step": equal_after_step,
        "norms": norms,
        "clipped": norms[0] > 0.05,
        "class": type(optimizers[1]).__name__,
        "isinstance_adamw": isinstance(optimizers[1], torch.optim.AdamW),
        "state_types": sorted({f"{k}:{type(v).__name__}" for s in local_shard_state.values() for k, v in s.items()}),
        "state_keys_alike": [sorted(s) for s in optimizers[0].state.values()] ==
                            [sorted(s) for s in local_shard_state.values()],
        "grads_kept": all(isinstance(p.grad, DTensor) for p in nets[1].parameters()),
        "empty_shard": any(p.to_local().numel() == 0 for p in nets[1].parameters()),
        "moved": not torch.equal(nets[1][0].weight.to_local(), _first_weight_shard(mesh)),
        "hooks_saw": hooks_saw,
    }
    (out / f"rank{rank}_of{world}_{name}.json").write_text(json.dumps(result))


def _watch_step_hooks(opt: torch.optim.Optimizer) -> Tuple[dict, list]:
    """Registers a pre- and a post-hook on ``opt``, and global ones (torch runs them for every optimizer); each
    call of one about ``opt`` appends what ``opt`` held then: DTensors or plain tensors, as parameters and, once
    a step made it, as state. Returns the record and the global hooks' handles."""
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    saw = {"pre": [], "post": [], "global_pre": [], "global_post": []}

    def kinds(tensors):
        return {"DTensor" if isinstance(t, DTensor) else "plain" for t in tensors}

    def watcher(name):
        def hook(optimizer, args, kwargs):
            if optimizer is opt:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                moments = [v for p in params for v in optimizer.state.get(p, {}).values()
                           if torch.is_tensor(v) and v.dim() > 0]
                saw[name].append({"params": sorted(kinds(params)), "state": sorted(kinds(moments))})
        return hook

    opt.register_step_pre_hook(watcher("pre"))
    opt.register_step_post_hook(watcher("post"))
    handles = [register_optimizer_step_pre_hook(watcher("global_pre")),
               register_optimizer_step_post_hook(watcher("global_post"))]
    return saw, handles


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _first_weight_shard(mesh) -> torch.Tensor:
    from torch.distributed.fsdp import fully_shard

    fresh = model()
    fully_shard(fresh, mesh=mesh)
    return fresh[0].weight.to_local()


if __name__ == "__main__":
    sys.exit(main())
