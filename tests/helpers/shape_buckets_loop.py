"""A user's loop whose batches come in several shapes, in a random order: sequence lengths
32, 64 and 96 and batch sizes 8 and 12 (a last partial batch), through ``graphing.GraphedStep``.

    torchrun --nproc_per_node=N tests/helpers/shape_buckets_loop.py --out results.json

Runs the same steps eagerly and graphed from the same seed in one process (every rank draws
the same order of shapes, its own tokens), then graphed again with only the largest shape,
for the memory pool the other shapes add. Rank 0 writes each run's per-step losses, final
parameter checksum and graph report. tests/test_shapes_gpu.py compares them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import graphing  # noqa: E402

VOCAB, WIDTH = 128, 64
SHAPES = [(12, 32), (12, 64), (12, 96), (8, 96)]  # (batch, sequence length)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(96, WIDTH)
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=-1)
        heads = lambda z: z.view(*z.shape[:2], 4, WIDTH // 4).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(x.shape))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


def batches(steps: int, rank: int, shapes):
    order = random.Random(0).choices(range(len(shapes)), k=steps)  # the same order on every rank
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    for i in order:
        b, t = shapes[i]
        x = torch.randint(0, VOCAB, (b, t), generator=g)
        yield x.cuda(), ((x * 3 + 1) % VOCAB).cuda()  # a rule to learn: each token's successor


def run(mode: str, steps: int, rank: int, shapes) -> dict:
    torch.manual_seed(0)
    model = TinyLM().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)

    def train_step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        return loss.detach()

    step = graphing.GraphedStep(train_step, model, optimizer, mode=mode, max_graphs=len(shapes))
    losses = [float(step(x, y)) for x, y in batches(steps, rank, shapes)]
    torch.cuda.synchronize()
    report = step.report
    out = {"losses": losses, "param_sum": float(sum(p.double().sum() for p in model.parameters())),
           "graphs": [{"shape": g.shape, "capture_s": g.capture_s, "pool_mib": g.pool_mib} for g in report.graphs],
           "pool_mib": report.graph_pool_mib, "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20}
    step.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    results = {}
    for name, mode, shapes in (("eager", "eager", SHAPES), ("full", "full", SHAPES),
                               ("largest_alone", "full", [max(SHAPES, key=lambda s: s[0] * s[1])])):
        torch.cuda.reset_peak_memory_stats()
        results[name] = run(mode, args.steps, rank, shapes)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    gc.collect()  # free the DDP models' reducers while the group is up, then meet before tearing it down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
