"""The no-overlap model of DDP's gradient all-reduce, and a recipe's parameter count: what
scripts/project_scaling.py projects strong scaling with and scripts/bench_allreduce.py measures against.
The model's terms are in scripts/project_scaling.py's docstring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


# The exposed all-reduce measured on 2x H200 over NVLink (2026-11-24, torch 2.11, CIFAR ResNet-18,
# graph=full, 128 per GPU, without DDP's per-forward buffer broadcast, which buffer-free models
# do not have): 3.416 ms on two GPUs against 3.183 on one, 0.233 ms, 1.73x this model's 0.134 ms.
# scripts/results/RESULTS.md, "Issue 24, part 2".
MEASURED_ALLREDUCE_SCALE = 1.73


@dataclass
class Links:
    nvlink_gb_s: float = 360.0  # NCCL bus bandwidth of an all-reduce inside an H100/H200 NVLink node
    nvlink_latency_us: float = 5.0  # per ring step
    ib_gb_s: float = 45.0  # one 400 Gb/s NIC per GPU, at about 90% of line rate
    ib_latency_us: float = 10.0  # per ring step, across nodes
    gpus_per_node: int = 8


def allreduce_s(nbytes: float, gpus: int, links: Links) -> float:
    """Seconds for one all-reduce of ``nbytes`` over ``gpus`` GPUs (hierarchical ring; see the module docstring)."""
    if gpus <= 1:
        return 0.0
    g = min(gpus, links.gpus_per_node)
    nodes = math.ceil(gpus / g)
    t = 2 * (g - 1) / g * nbytes / (links.nvlink_gb_s * 1e9) + 2 * (g - 1) * links.nvlink_latency_us * 1e-6
    if nodes > 1:  # NCCL takes the faster of a ring and a (double binary) tree across nodes
        shard, alpha, bw = nbytes / g, links.ib_latency_us * 1e-6, links.ib_gb_s * 1e9
        ring = 2 * (nodes - 1) / nodes * shard / bw + 2 * (nodes - 1) * alpha
        tree = 2 * shard / bw + 2 * math.ceil(math.log2(nodes)) * alpha
        t += min(ring, tree)
    return t


def parameter_count_of(recipe: str) -> int:
    """``parameter_count`` of a built-in or conf/ recipe, by name."""
    from conf.schema import compose

    return parameter_count(compose([f"recipe={recipe}", "recipe.data.source=synthetic", "recipe.data.train_size=64",
                                    "recipe.data.test_size=16"]))


def parameter_count(cfg) -> int:
    """The trainable parameters of the recipe in ``cfg``, from its own builder (on the CPU; give it tiny data)."""
    from trainer.session import build_recipe_alone

    model = build_recipe_alone(cfg).model
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
