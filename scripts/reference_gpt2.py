"""The reference to beat: a single-file GPT-2 small trainer in the style of the public
nanoGPT-like scripts, with ``torch.compile``, timed. Its settings are pinned here, so that its
numbers mean the same in every device call (issue 24's yardstick).

    python scripts/reference_gpt2.py                          # micro-batch 16 x 1024, compiled, eager loop
    python scripts/reference_gpt2.py --batch-size 32
    python scripts/reference_gpt2.py --graphed                # the same step through graphing.GraphedStep
    python scripts/reference_gpt2.py --output ref.json        # the numbers as JSON too
    python scripts/reference_gpt2.py --loss chunked           # a lever, measured: chunked linear + cross-entropy
    python scripts/reference_gpt2.py --profile-steps 10 --output ref.json   # and where its step goes, by kernel

Pinned: 12 layers, 12 heads, width 768, context 1024, vocabulary 50304, no biases, tied
embedding, GELU MLP, flash attention (``F.scaled_dot_product_attention(is_causal=True)``),
bf16 autocast with fp32 weights, TF32 matmuls, AdamW (fused, lr 6e-4, betas 0.9/0.95,
weight decay 0.1 on matrices only), gradient clipping at 1.0, ``torch.compile(model)``
(mode default), random tokens already on the GPU (the data costs nothing), one micro-batch
per step, the loss computed inside the compiled forward, read on the host every ``--log-every`` steps (nanoGPT's
``loss.item()`` at its log interval; scripts/bench_gpt2.py gives train.py's train.log_every). Timed as train.py
times its steps (scripts/lib/timing.py): prints milliseconds per step (median over --steps after --warmup, a
metric read left out), tokens/s over the wall window of the timed steps (the first one's start to the last one's
end, every read between counted) and MFU from it against the GPU's dense bf16 peak (trainer/metrics/perf.py's
table; 6N + 12·L·d·T FLOPs per token); with ``--power`` also the GPU's power draw, SM clock and energy a step over
the timed steps (scripts/lib/gpu_power.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.lib.gpu_power import describe as describe_power, sampler  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402
from scripts.lib.timing import time_steps  # noqa: E402

LAYERS, HEADS, WIDTH, CONTEXT, VOCAB = 12, 12, 768, 1024, 50304
LR, BETAS, WEIGHT_DECAY, CLIP = 6e-4, (0.9, 0.95), 0.1, 1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences of 1024 tokens per step")
    parser.add_argument("--steps", type=int, default=50, help="steps timed")
    parser.add_argument("--warmup", type=int, default=15, help="steps before timing (compilation happens here)")
    parser.add_argument("--graphed", action="store_true", help="run the step through graphing.GraphedStep")
    parser.add_argument("--log-every", type=int, default=0,
                        help="read the loss on the host every this many steps (0: only after the last)")
    parser.add_argument("--output", type=Path, default=None, help="write the numbers here as JSON")
    parser.add_argument("--loss", choices=("inside", "chunked"), default="inside",
                        help="inside: cross-entropy inside the compiled forward (pinned); chunked: the output head "
                             "and loss fused in row chunks that never hold the whole logits (a lever to measure)")
    parser.add_argument("--chunk-rows", type=int, default=4096, help="--loss chunked: tokens per chunk")
    parser.add_argument("--power", action="store_true",
                        help="the GPU's energy, power and SM clock over the timed steps (NVML, read every 100 ms; "
                             "pip install nvidia-ml-py)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timed steps, this many more under torch.profiler: the JSON gets their GPU "
                             "work per step, read as scripts/profile_step.py reads train.py's (kernel kinds, top "
                             "kernels, idle gaps)")
    args = parser.parse_args()

    import torch

    import graphing
    from trainer.metrics.perf import peak_tflops

    if not torch.cuda.is_available():
        refuse("reference_gpt2.py times a GPU: this machine has no CUDA device")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = make_gpt2(chunked_loss_rows=args.chunk_rows if args.loss == "chunked" else None).cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS, fused=True)
    compiled = torch.compile(model)
    tokens = torch.randint(0, VOCAB, (8, args.batch_size, CONTEXT + 1), device="cuda")

    def train_step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)  # the loss inside the compiled forward, as the public scripts have it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
        return loss.detach()

    if args.graphed:
        step = graphing.GraphedStep(train_step, compiled, optimizer)
    else:
        step = lambda x, y: train_step(compiled, x, y)  # noqa: E731
    steps = Steps(step, tokens)
    with sampler(args.power, torch.cuda.current_device()) as power:  # --power: the GPU's draw, clock
        # train.py's timer and wall window, its metric reads at train.log_every's cadence
        timed = time_steps(steps, args.steps, warmup=args.warmup, log_every=args.log_every,
                           read_metrics=steps.read_metrics)
        end = time.monotonic()
    ms = timed["step_ms_median"]
    power_used = power.window(end - timed["wall_s"], end, timed["step_ms_mean"])  # the wall window, on this clock
    loss = steps.loss
    profiled = None
    if args.profile_steps:  # after the timing, on the batches from the first again
        from scripts.lib.kernel_profile import profile_steps

        steps.taken = 0
        profiled = profile_steps(steps.next_step, args.profile_steps, torch.cuda.current_device())
    n_params = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()
    flops_per_token = 6.0 * n_params + 12.0 * LAYERS * WIDTH * CONTEXT
    tokens_per_s = args.batch_size * CONTEXT * timed["wall_steps"] / timed["wall_s"]
    peak = peak_tflops(torch.cuda.get_device_name(0), "bf16")
    result = {"script": "reference_gpt2.py", "graphed": args.graphed, "batch_size": args.batch_size, "loss": args.loss,
              "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
              "step_ms_median": ms, "step_ms_p90": timed["step_ms_p90"], "wall_s": timed["wall_s"],
              "wall_steps": timed["wall_steps"], "log_every": args.log_every, "tokens_per_s": tokens_per_s,
              "final_loss": float(loss),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "mfu_pct": 100 * tokens_per_s * flops_per_token / (peak[1] * 1e12) if peak else None,
              **({"power": power_used} if power_used else {}), **({"profile": profiled} if profiled else {})}
    print(f"reference GPT-2 small{' (GraphedStep)' if args.graphed else ''}"
          f"{', chunked loss' if args.loss == 'chunked' else ''}, {args.batch_size}x{CONTEXT}: "
          f"{ms:.2f} ms/step (median), {tokens_per_s:,.0f} tokens/s (wall window)"
          + (f", {result['mfu_pct']:.1f}% MFU ({peak[0]})" if peak else ""))
    if power_used:
        print(describe_power(power_used))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


class Steps:
    """The reference's loop, one step a call, as scripts/lib/timing.py times a trainer: ``next_step`` and
    ``device``, and ``read_metrics``, its loss read on the host."""

    def __init__(self, step, tokens):
        self.step, self.tokens, self.device = step, tokens, tokens.device
        self.taken, self.loss, self.logged = 0, None, []

    def next_step(self) -> None:
        self.loss = self.step(*_split(self.tokens[self.taken % len(self.tokens)]))
        self.taken += 1

    def read_metrics(self) -> None:
        self.logged.append(self.loss.item())  # nanoGPT's `lossf = loss.item()` at its log interval: a host sync


def _split(batch):
    """A batch of windows of CONTEXT + 1 tokens as (inputs, next-token targets)."""
    return batch[:, :-1], batch[:, 1:]


def make_gpt2(chunked_loss_rows=None):
    """The pinned model; ``chunked_loss_rows``: its loss through ``chunked_linear_cross_entropy``."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
            self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
            self.c_fc, self.c_out = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(4 * WIDTH, WIDTH, bias=False)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
            return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x))))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(WIDTH, bias=False)
            self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith(("c_proj.weight", "c_out.weight")) else 0.02
                    torch.nn.init.normal_(p, mean=0.0, std=std)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            x = self.ln_f(x)
            if chunked_loss_rows:
                return chunked_linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                                    chunked_loss_rows)
            logits = self.lm_head(x)
            return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return GPT2()


def chunked_linear_cross_entropy(hidden, weight, targets, rows):
    """The mean cross-entropy of ``hidden @ weight.T`` against ``targets``, ``rows`` tokens at a
    time, so that only one chunk's logits exist at once (issue 24's fused linear + cross-entropy
    lever). The gradients are computed in the forward pass, chunk by chunk (the softmax minus
    the one-hot, times 1/N, then the two matmuls), and backward scales them: no host syncs, so a
    graph can hold it. On CUDA each chunk's softmax is one compiled kernel, and the matmuls run
    in bf16 with fp32 accumulation, as autocast's would.
    """
    import torch

    @torch.compiler.disable  # its loop and in-place gradient sums stay eager (a graph replays them anyway)
    def run(hidden, weight, targets):
        with torch.autocast(hidden.device.type, enabled=False):
            dtype = torch.bfloat16 if hidden.is_cuda else hidden.dtype
            return _linear_cross_entropy(hidden.is_cuda).apply(hidden.to(dtype), weight, targets, rows)

    return run(hidden, weight, targets)


def _chunk_loss_and_gradient(logits, targets, scale):
    """Per-token losses and d(sum of losses * scale)/d logits, for one chunk (compiled: one pass over it)."""
    import torch
    import torch.nn.functional as F

    lf = logits.float()
    lse = torch.logsumexp(lf, dim=1)
    losses = lse - lf.gather(1, targets[:, None]).squeeze(1)
    grad = (torch.exp(lf - lse[:, None]) - F.one_hot(targets, lf.shape[1]).to(lf.dtype)) * scale
    return losses, grad.to(logits.dtype)


@functools.lru_cache(maxsize=None)
def _linear_cross_entropy(compiled: bool):
    import torch

    chunk_kernel = torch.compile(_chunk_loss_and_gradient, dynamic=False) if compiled else _chunk_loss_and_gradient

    class LinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets, rows):
            w = weight.to(hidden.dtype)
            n = hidden.shape[0]
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, n, rows):
                h = hidden[start:start + rows]
                losses, grad = chunk_kernel(h @ w.t(), targets[start:start + rows], 1.0 / n)
                loss += losses.sum()
                torch.mm(grad, w, out=grad_hidden[start:start + rows])
                grad_weight += (grad.t() @ h).float()
            ctx.save_for_backward(grad_hidden, grad_weight)
            return loss / n

        @staticmethod
        def backward(ctx, grad_loss):
            grad_hidden, grad_weight = ctx.saved_tensors
            return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss, None, None

    return LinearCrossEntropy


if __name__ == "__main__":
    sys.exit(main())
