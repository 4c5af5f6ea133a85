"""Your own training loop, graphed: a small GPT trained nanoGPT's way through ``graphing.GraphedStep``.

    python scripts/own_loop.py                                   # one process: full on CUDA, eager otherwise
    torchrun --standalone --nproc_per_node=2 scripts/own_loop.py --steps 300 --output own_loop.json
    torchrun --standalone --nproc_per_node=2 scripts/own_loop.py --fsdp2   # sharded with FSDP2 instead of DDP

What you should see (rank 0 prints for the job). Two processes on a busy 2-core machine without CUDA:

    own_loop: mode=eager world_size=2 device=cpu steps=300 batch=2x16x64 tokens (per rank)
    step    50/300 | loss 1.4571 | grad norm 0.531 | lr 9.60e-03 | eager  |  253.58 ms/step
    step   100/300 | loss 0.9234 | grad norm 0.129 | lr 8.07e-03 | eager  |  133.25 ms/step
    step   100/300 | val loss 0.9694
    ...
    step   300/300 | loss 0.8905 | grad norm 0.074 | lr 1.00e-03 | eager  |   99.58 ms/step
    step   300/300 | val loss 0.9422
    done: final loss 0.8090, val loss 0.9422, weights digest f106bb615a5a9874 on every rank

"loss" and "grad norm" are the job's means over the log interval, "final loss" is rank 0's
last step. With CUDA the default is ``--mode full``: after the 11 warm-up steps the step is
captured once, the phase column reads "graph", and tests/test_own_loop.py compares such a run
with ``--mode eager`` step for step.

The model is a GPT (token and position embeddings, pre-norm blocks of causal self-attention
through F.scaled_dot_product_attention and an MLP, tied output head); the data is synthetic
text made on the host from ``--seed``: a fixed random successor for every token, followed from
a random start, with a jump to a random token at one position in eight (so the best loss on
text not seen in training is about 0.88 nats, from ln 64 = 4.16 at the start). Each rank
trains on its own shard of the batches.

The loop is nanoGPT's: AdamW (fused on CUDA) whose learning rate is written as a Python float
into every param group each iteration (linear warm-up, then cosine), two micro-batches per
step with DDP's all-reduce only on the last, gradient clipping, bf16 autocast on CUDA. The
step itself runs through ``GraphedStep``: eagerly for the warm-up, then as one CUDA graph per
rank (``--mode full``, the default with CUDA; ``--mode eager`` runs the same loop without a
graph, the default elsewhere, where ``--mode full`` stops with graphing's message and a
non-zero exit status). Metrics stay on the device (``graphing.RunningMeans``) and are read
once per ``--log-every`` steps; evaluation runs outside the graph every ``--eval-every`` steps.

``--fsdp2`` shards the model with FSDP2 instead of DDP, the way you would shard your own:
``fully_shard`` on each block, then on the root, over a 1-D device mesh of all ranks (a process
group of one without torchrun), with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
on CUDA. GraphedStep takes the sharded model as it is (no DDP around it), ``micro_batches`` turns
FSDP2's gradient sync off for all but the last micro-batch, ``RunningMeans`` takes the clipped
norm (a replicated DTensor) as it is, and the digest below is of the whole (gathered) parameters. On CPU, fp32, its losses equal DDP's to float rounding.

``--output FILE`` (rank 0) writes JSON: the settings, rank 0's loss and the lr of every step,
the job's means at each log line (with the step's phase: warmup, eager, capture, graph), the
validation losses, what GraphedStep reports (mode, capture seconds, graph pool MiB), and a
digest of the parameters from every rank (equal when DDP kept them in step; under ``--fsdp2``
each rank's digest is of the parameters gathered whole).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as `python scripts/own_loop.py`: find graphing/

import graphing  # noqa: E402

VOCAB = 64
JUMP_PROBABILITY = 1 / 8  # how often the synthetic text jumps to a random token
TRAIN_SEQUENCES, VAL_SEQUENCES = 16384, 256


# --- the model -----------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (batch, length, 3 * width) -> three of (batch, heads, length, head width)
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = SelfAttention(width, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.token.weight  # tied, as in GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token(tokens) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # logits: (batch, length, vocab)


# --- the data, the schedule, the process group ---------------------------------------------------

def make_text(seed: int, sequences: int, context: int) -> torch.Tensor:
    """(sequences, context + 1) tokens: each follows a fixed random successor table (the same for
    every ``seed`` call's sequences), jumping to a random token with JUMP_PROBABILITY."""
    successor = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + sequences)  # train and val sets differ, the table does not
    tokens = torch.empty(sequences, context + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (sequences,), generator=gen)
    jumps = torch.rand(sequences, context, generator=gen) < JUMP_PROBABILITY
    random_tokens = torch.randint(VOCAB, (sequences, context), generator=gen)
    for t in range(context):
        tokens[:, t + 1] = torch.where(jumps[:, t], random_tokens[:, t], successor[tokens[:, t]])
    return tokens


def lr_at(it: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``--lr`` over ``--lr-warmup`` steps, then cosine down to ``--lr / 10`` at the last step."""
    if it < args.lr_warmup:
        return args.lr * (it + 1) / args.lr_warmup
    progress = min(1.0, (it - args.lr_warmup) / max(1, args.steps - args.lr_warmup))
    min_lr = args.lr / 10
    return min_lr + (args.lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["full", "eager"], default=None,
                   help="full: one CUDA graph per rank; eager: no graph (default: full with CUDA, else eager)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-batch, per rank")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--context", type=int, default=64, help="tokens per sequence")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0, help="0 makes eager and full runs comparable step for step")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    p.add_argument("--lr-warmup", type=int, default=10, help="steps of linear lr warm-up before the cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.1, help="on matrices and embeddings; none on biases, norms")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-iters", type=int, default=graphing.DDP_MIN_WARMUP,
                   help="eager steps before capture (at least 11 under DDP)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=4, help="micro-batches per rank per evaluation")
    p.add_argument("--output", type=Path, default=None, help="write the run's results here as JSON (rank 0)")
    p.add_argument("--fsdp2", action="store_true",
                   help="shard the model with FSDP2 (fully_shard on each block, then the root) instead of DDP")
    args = p.parse_args()
    if args.mode is None:
        args.mode = "full" if torch.cuda.is_available() else "eager"
    return args


def setup_distributed(fsdp2: bool = False) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); joins the process group when launched by torchrun. Without torchrun,
    ``fsdp2`` (its device mesh needs a process group) makes a group of one, in this process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
        if fsdp2:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        return 0, 1, device
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)  # before the process group: NCCL binds to the current device
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def shard(model: GPT, device: torch.device) -> GPT:
    """``--fsdp2``: FSDP2 the way you would shard your own model: ``fully_shard`` on each transformer block,
    then on the root (the embeddings, the final norm, the tied head), over a 1-D mesh of all ranks. Each
    parameter becomes a DTensor holding this rank's shard; build the optimizer after this. bf16 compute
    and fp32 gradient reduction on CUDA (where the loop autocasts to bf16), fp32 throughout otherwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device.type == "cuda" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


# --- training ------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: nn.Module, text: torch.Tensor, args: argparse.Namespace, autocast) -> float:
    """Mean validation loss over every rank's shard, run eagerly on the module itself (not DDP's wrapper)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = next(model.parameters()).device
    model.eval()
    val_loss = graphing.RunningMeans(["loss"], device)
    for i in range(args.eval_batches):
        b = (i * world_size + rank) % (len(text) // args.micro_batch)
        chunk = text[b * args.micro_batch:(b + 1) * args.micro_batch].to(device)
        with autocast():
            logits = model(chunk[:, :-1])
        val_loss.add(loss=F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten()))
    model.train()
    return val_loss.read_and_reset(all_ranks=True)["loss"]


class Progress:
    """Rank 0's log lines (with the time per step since the last one) and the records for --output."""

    def __init__(self, rank: int, steps: int):
        self.say = print if rank == 0 else (lambda *a, **k: None)  # one voice: rank 0 speaks for the job
        self.steps, self.logged, self.evaluated = steps, [], []
        self.since, self.since_step = time.perf_counter(), 0

    def train(self, it: int, lr: float, phase: str, means: dict) -> None:
        now = time.perf_counter()
        ms = (now - self.since) * 1e3 / (it + 1 - self.since_step)
        self.say(f"step {it + 1:5d}/{self.steps} | loss {means['loss']:.4f} | grad norm {means['grad_norm']:.3f} "
                 f"| lr {lr:.2e} | {phase:6s} | {ms:7.2f} ms/step")
        self.logged.append({"step": it + 1, **means, "phase": phase, "ms_per_step": ms})
        self.since, self.since_step = now, it + 1

    def val(self, it: int, val_loss: float) -> None:
        self.say(f"step {it + 1:5d}/{self.steps} | val loss {val_loss:.4f}")
        self.evaluated.append({"step": it + 1, "val_loss": val_loss})
        self.since = time.perf_counter()  # keep evaluation out of the next ms/step


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> int:
    cuda = device.type == "cuda"
    batch_size = args.micro_batch * args.accum  # sequences per rank per step
    text = make_text(args.seed, TRAIN_SEQUENCES, args.context)
    val_text = make_text(args.seed, VAL_SEQUENCES, args.context)
    inputs, targets = text[:, :-1].contiguous(), text[:, 1:].contiguous()  # targets: each input's next token
    if cuda:  # pinned: the copy of a batch into the step's static inputs is asynchronous
        inputs, targets = inputs.pin_memory(), targets.pin_memory()
    batches = TRAIN_SEQUENCES // batch_size

    def batch_at(it: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = (it * world_size + rank) % batches  # this rank's shard: every world_size-th batch
        return inputs[b * batch_size:(b + 1) * batch_size], targets[b * batch_size:(b + 1) * batch_size]

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = GPT(VOCAB, args.context, args.width, args.layers, args.heads, args.dropout).to(device)
    if args.fsdp2:  # each rank keeps its shard of these same weights; GraphedStep puts no DDP around it
        model = shard(model, device)
    param_groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": args.weight_decay},
                    {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    progress = Progress(rank, args.steps)
    progress.say(f"own_loop: mode={args.mode} world_size={world_size}{' fsdp2' if args.fsdp2 else ''} "
                 f"device={device.type} steps={args.steps} "
                 f"batch={args.accum}x{args.micro_batch}x{args.context} tokens (per rank)")
    losses = torch.zeros(args.steps, device=device)  # rank 0's loss of every step, read once at the end
    lrs = [math.nan] * args.steps  # the lr written into every param group, each step

    # >>> README: the loop (tests/test_own_loop.py checks that docs/own_loop.md shows this part verbatim)
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, betas=(0.9, 0.95), fused=cuda)
    autocast = (lambda: torch.autocast("cuda", torch.bfloat16, cache_enabled=False)) if cuda else contextlib.nullcontext
    metrics = graphing.RunningMeans(["loss", "grad_norm"], device)  # sums on the device, read every log interval

    def train_step(model, x, y):  # model: DDP under torchrun (--fsdp2: sharded); no .item(), no host syncs in here
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for x_micro, y_micro in graphing.micro_batches(model, args.accum, x, y):  # no_sync on all but the last
            with autocast():
                logits = model(x_micro)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y_micro.flatten()) / args.accum  # summed: x's mean
            loss.backward()
            step_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip, foreach=True)  # on the device
        optimizer.step()
        metrics.add(loss=step_loss, grad_norm=grad_norm)
        return step_loss

    with graphing.GraphedStep(train_step, model, optimizer, mode=args.mode, warmup_iters=args.warmup_iters) as step:
        for it in range(args.steps):
            lr = lr_at(it, args)
            for group in optimizer.param_groups:
                group["lr"] = lr  # a float, nanoGPT's way: GraphedStep carries it into the graph
            loss = step(*batch_at(it))  # copies the batch into the step's static inputs, then runs it
            losses[it], lrs[it] = loss, lr  # the loss is copied on the device: no sync
            if (it + 1) % args.log_every == 0 or it + 1 == args.steps:
                progress.train(it, lr, step.phase, metrics.read_and_reset(all_ranks=True))  # the interval's one sync
            if (it + 1) % args.eval_every == 0 or it + 1 == args.steps:
                progress.val(it, evaluate(model, val_text, args, autocast))  # outside the graph, on the module
    # <<< README

    report = step.report  # leaving the `with` closed the step: its graph is released before the process group goes
    digest = graphing.weights_digest(model)  # on the device; under --fsdp2 over the shards (a collective, every rank)
    digests = [digest] * world_size
    if world_size > 1:
        dist.all_gather_object(digests, digest)  # one per rank: DDP should keep them equal
    info = {"mode": report.mode, "capture_error_mode": report.capture_error_mode, **report.as_results()}
    results = {
        "mode": args.mode, "world_size": world_size, "fsdp2": args.fsdp2, "device": device.type, "steps": args.steps,
        "micro_batch": args.micro_batch, "accum": args.accum, "context": args.context, "seed": args.seed,
        "lr_schedule": {"peak": args.lr, "min": args.lr / 10, "warmup": args.lr_warmup, "total": args.steps},
        "losses": losses.tolist(),  # rank 0's, one per step
        "lrs": lrs,
        "logged": progress.logged,  # the job's means over each log interval
        "evaluated": progress.evaluated,  # the job's validation loss
        "param_digests": digests,
        "info": {k: v for k, v in info.items() if not (isinstance(v, float) and not math.isfinite(v))},
    }
    progress.say(f"done: final loss {results['losses'][-1]:.4f}, val loss {progress.evaluated[-1]['val_loss']:.4f}, "
                 f"weights digest {digest}"
                 + (" on every rank" if len(set(digests)) == 1 else f" DIFFER across ranks: {digests}"))
    if rank == 0 and args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1))
    return 0 if len(set(digests)) == 1 else 1


def main() -> int:
    args = parse_args()
    rank, world_size, device = setup_distributed(args.fsdp2)
    try:
        code = train(args, rank, world_size, device)
        if dist.is_initialized():
            # Free what holds the process group (DDP's reducer, FSDP2's mesh, kept by reference cycles) while it is
            # up, and meet: left to the interpreter's exit, gloo's threads can abort it ("terminate called ...").
            gc.collect()
            dist.barrier()
        return code
    except graphing.GraphConfigError as err:  # a setting that cannot work: the same on every rank, say it once
        if rank == 0:
            print(f"own_loop.py: {err}", file=sys.stderr)
        return 2
    except graphing.CaptureError as err:  # all ranks agreed it failed; each says what it saw (causes may differ)
        print(f"own_loop.py [rank {rank}]: {err}", file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # after GraphedStep's close (the `with` above): graphs go first


if __name__ == "__main__":
    code = main()
    if code and int(os.environ.get("RANK", "0")) != 0:
        time.sleep(3)  # torchrun stops the job when a rank exits: let rank 0 print its message first
    sys.stdout.flush()
    sys.stderr.flush()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # As train.py's _exit_now: the graph and the process group are closed above; what remains are
        # C++ destructors of communication threads, seen to abort at exit when a peer is already gone.
        os._exit(code)
    sys.exit(code)
