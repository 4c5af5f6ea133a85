"""Your own training loop, graphed: a small MLP trained through ``graphing.GraphedStep``.

    python scripts/own_loop.py                                   # one process: full on CUDA, eager otherwise
    torchrun --standalone --nproc_per_node=2 scripts/own_loop.py --steps 300 --output own_loop.json

What you should see (rank 0 prints for the job). On a CPU-only machine, two processes:

    own_loop: mode=eager world_size=2 device=cpu steps=300 batch_size=64 (per rank)
    step     1/300 | loss 2.3039 | lr 3.00e-04 | warmup  |    5.22 ms/step
    step    50/300 | loss 1.4499 | lr 2.88e-03 | eager   |    4.53 ms/step
    ...
    step   300/300 | loss 0.3027 | lr 3.00e-04 | eager   |    2.47 ms/step
    done: final loss 0.3066, params sha256 81169b15626d2079 on every rank

With CUDA the mode is full: after the 11 warm-up steps one more line says
"captured the whole step in ... s (graph pool ... MiB)", the phase column then reads
"graph", and the ms/step drops. Same seed, same losses step for step in either mode
(tests/test_own_loop.py checks that on a GPU).

On a machine without CUDA the default is ``--mode eager`` (the same loop, no graph);
``--mode full`` there stops with graphing's message, printed once (by rank 0), and a
non-zero exit status.

The task: a fixed random "teacher" MLP labels random inputs, all made on the host from
``--seed``; the student learns to imitate it. Each rank trains on its own shard of the
batches. Everything the step changes lives on the device (learning rate, step counter,
per-step loss and lr records), so the captured graph advances them on every replay, and
eager and full runs of the same seed match step for step.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as `python scripts/own_loop.py`: find graphing/

import graphing  # noqa: E402

IN_DIM, HIDDEN, CLASSES = 32, 128, 10
BATCHES_PER_EPOCH = 64  # distinct batches in the synthetic dataset; the loop cycles through them


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["full", "eager"], default=None,
                   help="full: one CUDA graph per rank; eager: no graph (default: full with CUDA, else eager)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--lr-warmup", type=int, default=10, help="steps of linear LR warm-up before the cosine decay")
    p.add_argument("--warmup-iters", type=int, default=graphing.DDP_MIN_WARMUP,
                   help="eager steps before capture (at least 11 under DDP)")
    p.add_argument("--capture-error-mode", choices=["global", "thread_local", "relaxed"], default="global")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--output", type=Path, default=None, help="write the run's results here as JSON (rank 0)")
    args = p.parse_args()
    if args.mode is None:
        args.mode = "full" if torch.cuda.is_available() else "eager"
    return args


def setup_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device); joins the process group when launched by torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)  # before the process group: NCCL binds to the current device
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def make_data(seed: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs labelled by a fixed random teacher MLP; identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    n = BATCHES_PER_EPOCH * batch_size
    x = torch.randn(n, IN_DIM, generator=gen)
    w1 = torch.randn(IN_DIM, 64, generator=gen) / IN_DIM ** 0.5
    w2 = torch.randn(64, CLASSES, generator=gen) / 8.0
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y


def param_digest(model: nn.Module) -> str:
    """First 16 hex chars of the sha256 of every parameter's bytes: equal iff bitwise equal."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> int:
    log = print if rank == 0 else (lambda *a, **k: None)  # one voice: rank 0 speaks for the job

    x_all, y_all = make_data(args.seed, args.batch_size)
    if device.type == "cuda":
        x_all, y_all = x_all.pin_memory(), y_all.pin_memory()  # pinned: the copy into the graph's input is async

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP would broadcast rank 0's anyway)
    model = nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                          nn.Linear(HIDDEN, CLASSES)).to(device)  # no dropout: eager and full match step for step

    # A tensor lr on the device: the graph reads it on every replay, so the schedule below can rewrite it.
    lr = torch.tensor(args.lr, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01,
                                  **graphing.graph_safe_optimizer_kwargs(torch.optim.AdamW, device, {}))

    # Device-side state the step updates in place (a graph replays kernels, not Python).
    step_idx = torch.zeros((), dtype=torch.long, device=device)  # how many steps have run
    loss_sum = torch.zeros((), device=device)                    # read and reset at each log line
    losses = torch.zeros(args.steps, device=device)              # per-step loss, read once at the end
    lrs = torch.zeros(args.steps, device=device)                 # per-step lr, to show the schedule advanced
    min_lr = args.lr / 10

    def lr_at(t: torch.Tensor) -> torch.Tensor:
        """Linear warm-up to the peak, then cosine down to min_lr, from the device step counter."""
        t = t.float()
        warm = args.lr * (t + 1) / args.lr_warmup
        progress = ((t - args.lr_warmup) / max(1, args.steps - args.lr_warmup)).clamp(0.0, 1.0)
        cosine = min_lr + (args.lr - min_lr) * 0.5 * (1 + torch.cos(math.pi * progress))
        return torch.where(t < args.lr_warmup, warm, cosine)

    def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Graph-safe: no .item(), no tensor in an `if`, every write in place into a tensor made above.
        optimizer.zero_grad(set_to_none=True)
        lr.copy_(lr_at(step_idx))
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP all-reduces the gradients here (captured too)
        optimizer.step()
        loss = loss.detach()
        loss_sum.add_(loss)
        at = step_idx.view(1)
        losses.index_copy_(0, at, loss.view(1))  # losses[step_idx] = loss, without reading step_idx on the host
        lrs.index_copy_(0, at, lr.view(1))
        step_idx.add_(1)
        return loss

    step = graphing.GraphedStep(train_step, model, optimizer, mode=args.mode, warmup_iters=args.warmup_iters,
                                capture_error_mode=args.capture_error_mode)
    log(f"own_loop: mode={args.mode} world_size={world_size} device={device.type} steps={args.steps} "
        f"batch_size={args.batch_size} (per rank)")

    phases: Counter = Counter()
    last_log, last_logged = time.perf_counter(), 0
    with step:  # closes the graph (and its memory pool) before the process group goes
        for i in range(args.steps):
            b = (i * world_size + rank) % BATCHES_PER_EPOCH  # this rank's shard: every world_size-th batch
            x = x_all[b * args.batch_size:(b + 1) * args.batch_size]
            y = y_all[b * args.batch_size:(b + 1) * args.batch_size]
            phase = step.phase
            phases[phase] += 1
            step(x, y)  # copies x, y into the static inputs, then runs (or replays) the step
            if phase == "capture":
                captured = step.report.as_results()
                log(f"captured the whole step in {captured.get('train_capture_s', float('nan')):.2f} s "
                    f"(graph pool {captured.get('graph_pool_mib', float('nan')):.1f} MiB); replaying from here on")
            if i == 0 or (i + 1) % args.log_every == 0 or i + 1 == args.steps:
                mean_loss = loss_sum.item() / (i + 1 - last_logged)  # the one host sync per log interval
                loss_sum.zero_()
                now = time.perf_counter()
                ms = (now - last_log) * 1e3 / (i + 1 - last_logged)
                log(f"step {i + 1:5d}/{args.steps} | loss {mean_loss:.4f} | lr {lr.item():.2e} | "
                    f"{phase:7s} | {ms:7.2f} ms/step")
                last_log, last_logged = now, i + 1

        digest = param_digest(model)
        digests = [digest] * world_size
        if world_size > 1:
            dist.all_gather_object(digests, digest)  # one per rank: DDP should keep them equal
        report = step.report
        info = {"mode": report.mode, "capture_error_mode": report.capture_error_mode,
                "compile_model": report.compile_model, **report.as_results()}
        info = {k: v for k, v in info.items()
                if v is None or isinstance(v, (str, bool, int)) or isinstance(v, float) and math.isfinite(v)}
        results = {
            "mode": args.mode,
            "world_size": world_size,
            "device": device.type,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "seed": args.seed,
            "lr_schedule": {"peak": args.lr, "min": min_lr, "warmup": args.lr_warmup, "total": args.steps},
            "losses": losses.tolist(),  # rank 0's, one per step
            "lrs": lrs.tolist(),
            "steps_by_phase": dict(phases),
            "param_digests": digests,
            "param_stats": {name: [p.double().sum().item(), p.double().abs().sum().item()]
                            for name, p in model.named_parameters()},
            "info": info,
        }
    log(f"done: final loss {results['losses'][-1]:.4f}, params sha256 {digest}"
        + (" on every rank" if len(set(digests)) == 1 else f" DIFFER across ranks: {digests}"))
    if rank == 0 and args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))
    return 0 if len(set(digests)) == 1 else 1


def main() -> int:
    args = parse_args()
    rank, world_size, device = setup_distributed()
    try:
        return train(args, rank, world_size, device)
    except graphing.GraphConfigError as err:  # a setting that cannot work: the same on every rank, say it once
        if rank == 0:
            print(f"own_loop.py: {err}", file=sys.stderr)
        return 2
    except graphing.CaptureError as err:  # all ranks agreed it failed; each says what it saw (causes may differ)
        print(f"own_loop.py [rank {rank}]: {err}", file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    if code and int(os.environ.get("RANK", "0")) != 0:
        time.sleep(3)  # torchrun stops the job when a rank exits: let rank 0 print its message first
    sys.stdout.flush()
    sys.stderr.flush()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        os._exit(code)  # under torchrun: skip C++ finalizers of communication threads (seen to abort at exit)
    sys.exit(code)
