"""A user's own training loop, shaped the way nanoGPT-style scripts are written, run through
``graphing.GraphedStep`` as it stands: a float lr written into every param group each iteration
(warm-up, then cosine), AdamW built with ``fused=True`` and no ``capturable``, two param groups
(decay / no decay), two micro-batches accumulated under ``no_sync``, gradient clipping, and
optionally the model wrapped in DDP by the user before it is handed over.

    torchrun --nproc_per_node=N tests/helpers/nanogpt_shaped_loop.py --out results.json [--prewrap]

Runs the same loop eagerly and graphed (``--modes eager,full``) from the same seed in one
process and writes each mode's per-step losses, lrs and final parameter checksum (rank 0).
tests/test_graphed_step_gpu.py compares them.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import graphing  # noqa: E402

VOCAB, WIDTH, CONTEXT, LAYERS = 64, 64, 32, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.blocks(x))


def lr_at(it: int, steps: int, peak: float = 3e-3, warmup: int = 8) -> float:
    if it < warmup:
        return peak * (it + 1) / warmup
    return 0.1 * peak + 0.45 * peak * (1 + math.cos(math.pi * (it - warmup) / max(1, steps - warmup)))


def batches(rank: int, steps: int, micro: int = 2, batch: int = 8):
    """Each step's (x, y): micro-batches stacked on dim 0; a learnable sequence task, per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (micro, batch, 1), generator=g)
        stride = torch.randint(1, 4, (micro, batch, 1), generator=g)
        seq = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB
        out.append((seq[..., :-1].contiguous(), seq[..., 1:].contiguous()))
    return out


def train(mode: str, args, rank: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = TinyLM().to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr_at(0, args.steps), betas=(0.9, 0.95), fused=device.type == "cuda")
    handed = model
    if args.prewrap and dist.is_initialized():
        handed = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                     bucket_cap_mb=1)

    def train_step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=x.device)
        for micro in range(x.shape[0]):
            last = micro == x.shape[0] - 1
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                logits = model(x[micro])
                loss = F.cross_entropy(logits.flatten(0, 1), y[micro].flatten()) / x.shape[0]
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        return total

    step = graphing.GraphedStep(train_step, handed, optimizer, mode=mode)
    losses, lrs = [], []
    for it, (x, y) in enumerate(batches(rank, args.steps)):
        lr = lr_at(it, args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr  # nanoGPT's pattern: a Python float, every iteration
        losses.append(step(x, y).clone())
        lrs.append(optimizer.param_groups[0]["lr"])  # what the loop logs
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    phase, made_safe, wrapped = step.phase, step.made_safe, type(step.model.module).__name__ \
        if hasattr(step.model, "module") else type(step.model).__name__
    step.close()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"losses": torch.stack(losses).tolist(), "lrs": lrs, "phase": phase, "made_safe": made_safe,
            "wrapped_module": wrapped, "param_sum": checksum}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="eager,full")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prewrap", action="store_true", help="wrap the model in DDP before GraphedStep gets it")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        rank = dist.get_rank()
    else:
        device, rank = torch.device("cuda" if cuda else "cpu"), 0
    results = {mode: train(mode, args, rank, device) for mode in args.modes.split(",")}
    if rank == 0:
        args.out.write_text(json.dumps(results))
    if dist.is_initialized():
        gc.collect()  # free the DDP models' reducers (in reference cycles) while the group is up, then meet
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
