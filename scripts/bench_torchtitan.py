"""This repo against torchtitan (PyTorch's reference trainer) on the GPUs of one machine, Llama 3 8B and a 1B
shape, in one table (issue 40).

    python scripts/bench_torchtitan.py                                 # both sizes, every GPU, both sides
    python scripts/bench_torchtitan.py --size 8b --nproc 4 --steps 30
    python scripts/bench_torchtitan.py --size 1b --ours full --theirs compiled --ac full
    python scripts/bench_torchtitan.py --size 8b --ours none --append  # one side now, the other in a later call
    python scripts/bench_torchtitan.py --size 1b --float8              # float8 on both sides
    python scripts/bench_torchtitan.py --size 1b --repeats 3 --matched-init  # 3 alternating runs a side, one init
    python scripts/bench_torchtitan.py --size 1b --strong-scaling --global-batch 4  # 4 x 8192 tokens on 1, 2, 4 GPUs
    python scripts/bench_torchtitan.py --dry-run --nproc 2             # what both sides would run; no GPU needed

For each size it runs torchtitan training its own Llama 3 model (``--theirs``: eager, compiled), then this
repo training the same architecture (``--ours``: ``graph=full``, ``graph=full_compiled``), one run after
another on ``--nproc`` GPUs, and prints one table: tokens/s per GPU, MFU, step ms median and p90, peak
allocated and reserved memory per GPU, and the loss at the first and the last step (both start from random
weights: about ln(128256) = 11.8 at step 1). tokens/s per GPU come from each run's wall window: the tokens of
its timed steps over the time from the first one's start to the last one's end (trainer/metrics/perf.py
WallWindow, on both sides), so that whatever a side does between its steps counts; the step times beside them
leave a metric read out.

torchtitan's side: its own model, sharding and optimizer, in this repo's small loop (not its trainer).
scripts/lib/torchtitan_worker.py, under torchrun, builds torchtitan 0.2.2's Llama 3 model
(``torchtitan.models.llama3``, TransformerModelArgs of its ``8B`` flavour), applies its ``parallelize_llama``
(FSDP2 with bf16 parameters and fp32 gradient reduction, per-block ``torch.compile`` with the loss compiled
too, activation checkpointing as torchtitan applies them) and its optimizer and LR scheduler builders, and
runs what torchtitan's ``Trainer.train_step`` does (forward, summed loss over the global token count,
backward, gradient clipping at 1.0, optimizer step, scheduler step) on synthetic token ids. Why not
torchtitan's own trainer (``torchtitan.train``): its data stack reads its tokenizer and the c4_test data from
the torchtitan repository's tests/assets, which the wheel does not carry, and the GPU machines reach no
network to fetch them; it times steps with its own logger (a mean between log lines), not with the timer
whose median and p90 this table reports; and it would train on other text than this repo's side. The
worker drives the same model, sharding, compile, activation checkpointing, optimizer, schedule and step
order; what is left out is its data loader, checkpointing, metrics logging and validation.

This repo's side: ``train.py recipe=hf_causal_lm`` with the same shape as a transformers LlamaConfig
(``recipe.model.config``: scripts/lib/llama3.py ``hf_config``), ``train.parallel=fsdp2``, through
scripts/lib/launch.py as scripts/compare.py launches its runs, its numbers from results.json and its losses
from metrics.jsonl (``train.log_every=1``; the worker reads its loss on the host as often, ``--log-every 1``).

Matched on both sides: the shape; the data (the same windows of the synthetic language of
``recipe.data.source=synthetic``, each used once, in each side's own order); ``--seq-len`` x ``--local-batch`` tokens per GPU per step; FSDP2 over every GPU
with fp32 weights, bf16 compute and fp32 gradient reduction, resharding blocks after forward (``--reshard never``:
neither side reshards, its weights stay gathered from forward to backward); activation
checkpointing, ``--ac``: ``full`` recomputes every transformer block on both sides (torchtitan's ``full``
mode; ``train.activation_checkpointing=true``), ``none`` neither (default ``auto``: full for 8b, none for
1b); fused AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1: torchtitan's 8B preset), linear LR
warm-up over 10 steps then constant, gradient clipping at 1.0; ``--warmup-steps`` untimed steps (this repo:
11 eager steps, then the capture) and ``--steps`` timed ones, with the same timer (graphing.StepTimer).
``--float8``: tensorwise float8 matmuls with FSDP2's float8 all-gather on both sides, each side's own way:
torchtitan's float8 converter as its docs/float8.md gives it (``model.converters=quantize.linear.float8``,
``enable_fsdp_float8_all_gather``, ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step,
``filter_fqns=["output"]``), against ``train.float8=tensorwise train.fsdp.float8_all_gather=true``
(docs/float8.md: the decoder layers' Linear layers, lm_head left out; the scales computed first in each step).
MFU uses one FLOP formula for both (scripts/lib/llama3.py ``training_flops_per_token``:
6 x (parameters - token embedding) + 12 x layers x width x sequence length per token, what both trainers
log) against trainer/metrics/perf.py's dense bf16 peak of the GPU.

Shapes (scripts/lib/llama3.py): ``8b`` is torchtitan's 8B flavour, 4096 x 32 layers, 32 heads / 8 KV heads,
FFN 14336, vocabulary 128256, RoPE theta 500000: 8,030,261,248 parameters. torchtitan 0.2.2 has no ~1B
Llama 3 flavour, so ``1b`` is 2048 x 16 layers, 32 heads / 8 KV heads, FFN 8192, the rest as 8B, head
untied: 1,498,482,688 parameters.

What fits where: fp32 weights, gradients and AdamW's moments take 16 bytes per parameter, sharded over the
GPUs: 128.5 GB for 8B (64 GB per GPU on 2, 32 on 4, 16 on 8), 24 GB for 1B. Activations and logits at 8192
x 1 tokens per GPU add roughly 10-15 GB with ``--ac full`` and 45-60 GB for 8B with ``--ac none``
(measured on 4 H200s, peak reserved per GPU: 44-58 GiB with ``--ac full``, 76-105 GiB with ``none``). So 8B at 8192 x 1: ``--ac full`` on 2 or more H200s (about 139 GiB each) or 4
or more H100s (about 78 GiB); ``--ac none`` wants 4 or more H200s. 1B fits one GPU either way. This repo's
side builds the model on the meta device as torchtitan does (``train.fsdp.init=meta``: sharded, then
each rank draws its own shards), so no rank holds the 8B model whole. A run that fails (out of memory, say) stays in the table with its status; the script then exits 1.

``--repeats N``: each side's runs N times, alternating (torchtitan's, this repo's, torchtitan's, ...); a row
is the median of its runs and the ratio gets its range over the pairs (repeat i against torchtitan's best of
repeat i). ``--matched-init``: torchtitan's model is drawn again as transformers' Llama draws this repo's (every
Linear and embedding weight from N(0, 0.02), the norms 1), so that the two loss curves can be laid side by side.
Every table gets the curves in a PNG beside it (scripts/lib/loss_plot.py) and a time to loss: from the launch,
start-up, compile and capture included, to the first step at which the last 10 steps' mean loss is at or below
the higher of the sides' final 10-step means. ``--strong-scaling``: one global batch (``--global-batch``
sequences a step, 4 by default) on 1, 2, 4, ... GPUs up to ``--nproc``, both sides, with each run's scaling
efficiency (its tokens/s per GPU over the same run's on one GPU).

Prints the table; writes it to ``--output`` (default scripts/results/torchtitan_<N>gpu.json, with the
Markdown beside it as .md) and every run's directory and logs under ``--runs``. Every row records the commit,
the versions of torch, torchtitan, torchao and transformers and the GPU it was measured with
(scripts/lib/comparison.py). ``--append`` keeps the rows of an existing ``--output`` that this call does not
rerun, so several calls (one per size or side) make one table; it refuses (exit 2, before anything runs) a table
whose rows were measured at another commit, with other versions or on another GPU.
Needs torchtitan for ``--theirs`` (``pip install -r scripts/requirements-torchtitan.txt``) and CUDA GPUs;
without either it says so and exits 2. ``--dry-run`` needs neither.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as `python scripts/bench_torchtitan.py`: find conf/ and scripts/

from scripts.lib.comparison import (  # noqa: E402
    check_append, comparison_rows, exit_status, provenance, provenance_line, with_provenance,
)
from scripts.lib.launch import (  # noqa: E402
    RESERVED, command, cuda_device_count, exit_on_sigterm, failure_line, hydra_value, launch_mode, override_key,
    run_captured, timestamp,
)
from scripts.lib.llama3 import (  # noqa: E402
    BETAS, EPS, LR, LR_WARMUP_STEPS, MAX_NORM, SHAPES, WEIGHT_DECAY, LlamaShape, hf_config, mfu_pct,
    parameter_count, training_flops_per_token,
)
from scripts.lib.refuse import refuse  # noqa: E402
from conf.schema import FSDPRoot  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402
from trainer.metrics.results import markdown_table, write_json  # noqa: E402

SCRIPT = "bench_torchtitan.py"
TORCHTITAN = "0.2.2"  # the release read for the shapes and settings; scripts/requirements-torchtitan.txt pins it
THEIRS, OURS = ("eager", "compiled"), ("full", "full_compiled")
RESHARDS = ("after-forward", "never")  # FSDP2 on both sides: each side's default, or weights kept gathered
GLOBAL_BATCH = 4  # --strong-scaling's sequences a step over all GPUs: 1b at 4 x 8192 tokens fits one GPU
ROOTS = tuple(r.value for r in FSDPRoot)  # train.fsdp.root's own choices: this repo's side only (--root)
TORCHTITAN_ALLOC_CONF = "expandable_segments:True"  # torchtitan's launcher (run_train.sh) runs its trainer with it
INSTALL = (f"install it: pip install -r scripts/requirements-torchtitan.txt (torchtitan=={TORCHTITAN} and its "
           "requirements). On a machine without a package index, bring them as wheels: on one with pip, "
           "`pip download --no-deps -d wheels -r scripts/requirements-torchtitan.txt` (with --python-version and "
           "--platform of that machine), then there `pip install --no-index --no-deps wheels/*.whl`")
LOG_EVERY = 1  # both sides read their loss on the host every step: every step's loss for the curves
OUR_WARMUP = 12  # this repo's untimed steps at least: graph.warmup_iters=11 eager steps, then the capture step
# Settings of this repo's runs that the comparison depends on, refused as the user's overrides: these keys
# exactly, and every key under the second group's.
SETS = (*RESERVED, "recipe", "logger", "seed")
SETS_UNDER = ("recipe.model", "recipe.optim", "recipe.schedule", "recipe.data.source", "recipe.data.batch_size",
              "recipe.data.train_size", "recipe.data.test_size", "recipe.data.drop_last", "recipe.accuracy",
              "train.parallel", "train.precision", "train.fsdp.reduce_dtype", "train.fsdp.reshard_after_forward",
              "train.fsdp.root",
              "train.activation_checkpointing",
              "train.grad_clip", "train.grad_accum", "train.max_steps", "train.epochs", "train.eval",
              "train.log_every", "graph.warmup_iters")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 (scripts/lib/refuse.py), not argparse's usage and message
        refuse(f"{SCRIPT}: {message} (see {SCRIPT} --help)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def variants(allowed: Sequence[str], flag: str):
    def parse(text: str) -> List[str]:
        if text.strip() == "none":
            return []
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: choose from {', '.join(allowed)}, comma-separated, "
                                             "or none")
        return list(dict.fromkeys(items))
    return parse


@dataclass(frozen=True)
class Plan:
    """One size's runs: what both sides train and for how long."""
    shape: LlamaShape
    nproc: int
    seq_len: int
    local_batch: int
    warmup_steps: int
    steps: int
    ac: str  # none | full
    seed: int = 0
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF of both sides' processes ("": torch's default allocator)
    reshard: str = RESHARDS[0]  # FSDP2's blocks resharded after forward on both sides, or "never"
    float8: bool = False  # tensorwise float8 matmuls with FSDP2's float8 all-gather, on both sides (--float8)
    matched_init: bool = False  # torchtitan's weights drawn as transformers' Llama draws this repo's (--matched-init)
    root: str = ROOTS[0]  # this repo's train.fsdp.root (--root); torchtitan's side keeps its own layout

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def tokens_per_gpu_step(self) -> int:
        return self.seq_len * self.local_batch

    @property
    def flops_per_token(self) -> float:
        return training_flops_per_token(self.shape, self.seq_len)


def plans(args: argparse.Namespace, nproc: int) -> List[Plan]:
    """Each size's plan on ``nproc`` GPUs; with ``--strong-scaling``, one per GPU count of ``scaling_counts``, each
    with the same global batch (``--global-batch`` sequences a step, split over the GPUs)."""
    sizes = list(SHAPES) if args.size == "both" else [args.size]
    global_batch = args.global_batch or GLOBAL_BATCH
    layouts = ([(n, global_batch // n) for n in scaling_counts(global_batch, nproc)]
               if args.strong_scaling else [(nproc, args.local_batch)])
    return [Plan(SHAPES[size], n, args.seq_len, local_batch, args.warmup_steps, args.steps,
                 args.ac if args.ac != "auto" else ("full" if size == "8b" else "none"), args.seed, args.alloc_conf,
                 args.reshard, args.float8, args.matched_init, args.root) for size in sizes
            for n, local_batch in layouts]


def scaling_counts(global_batch: int, most: int) -> List[int]:
    """The GPU counts of a strong-scaling series up to ``most``: 1, 2, 4, 8, ... and ``most`` itself, those that
    split ``global_batch`` sequences evenly."""
    counts = sorted({n for n in (1, 2, 4, 8, 16, 32, most) if n <= most})
    return [n for n in counts if global_batch % n == 0]


# ---- the commands of both sides --------------------------------------------------------

def theirs_command(plan: Plan, variant: str, output: Path, deadline_s: float, profile_steps: int = 0) -> List[str]:
    """torchrun over scripts/lib/torchtitan_worker.py (a module: it imports scripts.lib and recipes)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={plan.nproc}",
            "-m", "scripts.lib.torchtitan_worker", "--size", plan.shape.name, "--seq-len", str(plan.seq_len),
            "--local-batch", str(plan.local_batch), "--warmup-steps", str(plan.warmup_steps),
            "--steps", str(plan.steps), "--ac", plan.ac, *(["--compile"] if variant == "compiled" else []),
            "--reshard", "never" if plan.reshard == "never" else "default",
            *(["--float8"] if plan.float8 else []), *(["--init", "normal"] if plan.matched_init else []),
            "--seed", str(plan.seed), "--log-every", str(LOG_EVERY), "--deadline-s", f"{deadline_s:g}",
            "--output", str(output),
            *(["--profile-steps", str(profile_steps)] if profile_steps else [])]


def ours_overrides(plan: Plan) -> List[str]:
    """train.py's overrides for this repo's side of ``plan`` (scripts/lib/launch.py adds graph= and output_root=)."""
    windows = plan.nproc * plan.local_batch * plan.total_steps  # every step in one epoch, each window used once
    return ["recipe=hf_causal_lm", "recipe.model.config=null",
            f"+recipe.model.config={hydra_value(hf_config(plan.shape))}", f"recipe.model.context={plan.seq_len}",
            "recipe.data.source=synthetic", f"recipe.data.batch_size={plan.local_batch}",
            f"recipe.data.train_size={windows}", f"recipe.data.test_size={plan.nproc}", "recipe.data.drop_last=true",
            "recipe.accuracy=false",  # torchtitan computes no accuracy: no top-1 over the vocabulary per step
            f"recipe.optim.lr={LR!r}", f"recipe.optim.betas={hydra_value(list(BETAS))}",
            f"recipe.optim.weight_decay={WEIGHT_DECAY!r}", f"+recipe.optim.eps={EPS!r}",
            "recipe.schedule._target_=trainer.step.schedules.Constant", f"recipe.schedule.warmup_steps={LR_WARMUP_STEPS}",
            "~recipe.schedule.min_lr_ratio",
            "train.parallel=fsdp2", "train.fsdp.init=meta", "train.precision=bf16", "train.fsdp.reduce_dtype=fp32",
            f"train.fsdp.reshard_after_forward={'false' if plan.reshard == 'never' else 'true'}",
            f"train.fsdp.root={plan.root}",
            f"train.activation_checkpointing={'true' if plan.ac == 'full' else 'false'}",
            f"train.grad_clip={MAX_NORM!r}", "train.grad_accum=1", f"train.max_steps={plan.total_steps}",
            "train.epochs=1", "train.eval=false", f"train.log_every={LOG_EVERY}", "train.progress=false",
            f"graph.warmup_iters={plan.warmup_steps - 1}", "checkpoint.save=false", "logger=none",
            f"seed={plan.seed}",
            *(["train.float8=tensorwise", "train.fsdp.float8_all_gather=true"] if plan.float8 else [])]


def ours_args(plan: Plan, args: argparse.Namespace) -> List[str]:
    return [*args.train_options, *ours_overrides(plan), *args.overrides]


def profile_command(plan: Plan, mode: str, args: argparse.Namespace, folder: Path) -> List[str]:
    """scripts/profile_step.py over this repo's side of ``plan`` in graph ``mode``: after the warm-up and capture,
    ``args.profile`` steps settle, as many are timed, as many profiled; its data and max_steps hold them all (a
    run of its own, not the table's timed run; every other setting is that run's)."""
    n = args.profile
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={plan.nproc}",
            "scripts/profile_step.py", "--steps", str(n), "--top", "20", "--gaps", "6", "--streams", "--memory",
            "--output", str(folder / "profile.json"), *args.train_options,
            *ours_overrides(dataclasses.replace(plan, steps=3 * n)), *args.overrides, f"graph={mode}",
            f"output_root={hydra_value(str(folder))}"]


def group_of(plan: Plan) -> str:
    return f"bench_torchtitan-{plan.shape.name}"


def matched_settings(plan: Plan) -> List[Tuple[str, str, str]]:
    """(setting, torchtitan's side, this repo's side): what the table's two sides hold equal."""
    s = plan.shape
    ac = {"full": ("activation_checkpoint.mode=full (every block)", "train.activation_checkpointing=true (every block)"),
          "none": ("activation_checkpoint.mode=none", "train.activation_checkpointing=false")}[plan.ac]
    return [
        ("model", f"torchtitan Transformer, TransformerModelArgs {s.flavour or '8B, resized'}",
         "transformers LlamaForCausalLM from recipe.model.config"),
        ("shape", f"{s.layers} x {s.dim}, {s.heads} heads / {s.kv_heads} KV, FFN {s.ffn_hidden}, vocab {s.vocab}",
         "the same (hidden_size, num_hidden_layers, ..., intermediate_size, vocab_size)"),
        ("RoPE", f"theta {s.rope_theta:g}, Llama 3.1 scaling (factor 8)", "rope_parameters: rope_type llama3, the same"),
        ("attention (not matched)", "SDPA, causal, cuDNN's kernel first (torchtitan's wrapper)",
         "SDPA, causal, as transformers calls it (torch's kernel order)"),
        ("initial weights", "init_weights, then every Linear and embedding weight redrawn from N(0, 0.02) and the "
         "norms set to 1 (--matched-init: the worker's --init normal)",
         "transformers' LlamaForCausalLM init: N(0, initializer_range 0.02) for every Linear and embedding weight, "
         "norms 1 (the same scheme; each side draws its own values)") if plan.matched_init else
        ("initial weights (not matched)", "torchtitan's init_weights (depth-scaled; the token embedding std 1)",
         "transformers' (normal, std 0.02, the token embedding too): the losses differ by tenths at step 1 and by "
         "more later (--matched-init draws torchtitan's model the same way)"),
        ("tokens per GPU per step", f"{plan.seq_len} x {plan.local_batch}",
         f"recipe.model.context={plan.seq_len}, recipe.data.batch_size={plan.local_batch}"),
        ("data", f"the same windows of the synthetic language (recipes.gpt), seed {plan.seed}",
         f"recipe.data.source=synthetic, seed={plan.seed}"),
        ("sharding", "parallelize_llama: FSDP2 over every GPU, " + (
            "never resharded after forward (fsdp_reshard_after_forward=never)" if plan.reshard == "never" else
            "blocks resharded after forward (fsdp_reshard_after_forward=default)")
         + "; built on the meta device, each rank drawing its shards",
         f"train.parallel=fsdp2, train.fsdp.reshard_after_forward={'false' if plan.reshard == 'never' else 'true'}, "
         f"train.fsdp.root={plan.root}, train.fsdp.init=meta"),
        ("precision", "fp32 weights; FSDP2 bf16 parameters, fp32 reduce",
         "train.precision=bf16 (FSDP2 bf16 parameters), train.fsdp.reduce_dtype=fp32"),
        ("activation checkpointing", *ac),
        ("compile", "eager; compiled: compile.enable (each block, and the loss)",
         "graph=full (one CUDA graph); full_compiled: each block compiled, the loss apart, in the graph"),
        ("optimizer", f"AdamW fused, lr {LR:g}, betas {BETAS[0]}/{BETAS[1]}, eps {EPS:g}, weight decay {WEIGHT_DECAY}",
         "recipe.optim: torch.optim.AdamW, the same (fused)"),
        ("LR schedule", f"warm-up {LR_WARMUP_STEPS} steps, then constant", f"trainer.step.schedules.Constant, warmup_steps={LR_WARMUP_STEPS}"),
        ("gradient clipping", f"max_norm {MAX_NORM}", f"train.grad_clip={MAX_NORM}"),
        ("steps", f"{plan.warmup_steps} untimed, {plan.steps} timed",
         f"{plan.warmup_steps - 1} eager + capture untimed, {plan.steps} timed (graph.warmup_iters)"),
        ("metric reads", f"the loss read on the host every {LOG_EVERY} step{'s' * (LOG_EVERY > 1)} (the worker's "
         f"--log-every), as its trainer reads at its log step", f"train.log_every={LOG_EVERY}"),
        ("float8", "model.converters=quantize.linear.float8 (tensorwise), enable_fsdp_float8_all_gather, "
                   "precompute_float8_dynamic_scale_for_fsdp after each optimizer step, filter_fqns=[output]"
         if plan.float8 else "off",
         "train.float8=tensorwise, train.fsdp.float8_all_gather=true (the scales computed first in each step; the "
         "rule: Linear layers of the decoder layers, lm_head left out)" if plan.float8 else "train.float8=none"),
        ("CUDA allocator", f"PYTORCH_CUDA_ALLOC_CONF={plan.alloc_conf or '(unset)'}"
         + (" (what torchtitan's run_train.sh sets)" if plan.alloc_conf == TORCHTITAN_ALLOC_CONF else ""), "the same"),
    ]


# ---- rows of the table -----------------------------------------------------------------

def make_row(plan: Plan, run: str, status: str, timed: Dict[str, Any], peaks: Tuple[Any, Any],
             losses: Sequence[Optional[float]], peak_tflops: Optional[float],
             run_dir: Optional[str], profile: Optional[Dict[str, Any]] = None, *, repeat: int = 0,
             launched_at: Optional[float] = None, ended_at: Sequence[Optional[float]] = ()) -> Dict[str, Any]:
    """One run's row. tokens/s per GPU = tokens per GPU per step x the steps of its wall window / that window's
    seconds, MFU from the one FLOP formula (scripts/lib/llama3.py), for both sides alike. ``launched_at`` and
    ``ended_at`` (the host's clock at the launch and at each step's end) give the time to loss
    (``with_time_to_loss``)."""
    mean, wall_s, wall_steps = timed.get("step_ms_mean"), timed.get("wall_s"), timed.get("wall_steps")
    tokens = plan.tokens_per_gpu_step * wall_steps / wall_s if wall_s and wall_steps else None
    mfu = mfu_pct(tokens, plan.flops_per_token, peak_tflops) if tokens and peak_tflops else None
    return {"size": plan.shape.name, "run": run, "nproc": plan.nproc, "seq_len": plan.seq_len,
            "local_batch": plan.local_batch, "ac": plan.ac, "tokens_per_s_per_gpu": tokens, "mfu_pct": mfu,
            "step_ms_median": timed.get("step_ms_median"), "step_ms_p90": timed.get("step_ms_p90"),
            "step_ms_mean": mean, "warmup_steps": plan.warmup_steps, "steps_timed": timed.get("steps_timed"),
            "wall_s": wall_s, "wall_steps": wall_steps,
            "peak_allocated_mib": peaks[0], "peak_reserved_mib": peaks[1],
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "losses": list(losses), "status": status, "run_dir": run_dir,
            "alloc_conf": plan.alloc_conf or None, "reshard": plan.reshard, "float8": plan.float8,
            "matched_init": plan.matched_init, "repeat": repeat, "launched_at": launched_at,
            "step_ended_at": list(ended_at), **({"profile": profile} if profile else {})}


def theirs_row(plan: Plan, variant: str, result: Optional[Dict[str, Any]], status: str,
               peak_tflops: Optional[float], run_dir: Optional[str], *, repeat: int = 0,
               launched_at: Optional[float] = None) -> Dict[str, Any]:
    r = result or {}
    return make_row(plan, f"torchtitan {variant}", status, r, (r.get("peak_allocated_mib"), r.get("peak_reserved_mib")),
                    r.get("losses") or [], peak_tflops, run_dir, r.get("profile"), repeat=repeat,
                    launched_at=launched_at, ended_at=r.get("step_ended_at") or [])


def ours_row(plan: Plan, mode: str, outcome: Dict[str, Any], peak_tflops: Optional[float],
             profile: Optional[Dict[str, Any]] = None, *, repeat: int = 0,
             launched_at: Optional[float] = None) -> Dict[str, Any]:
    r = outcome.get("results") or {}
    status = comparison_rows([outcome])[0]["status"]  # flags a fallback to eager, or only warm-up steps timed
    timed = {k.removeprefix("perf/"): r.get(k) for k in ("perf/step_ms_median", "perf/step_ms_p90",
                                                          "perf/step_ms_mean", "perf/steps_timed", "perf/wall_s",
                                                          "perf/wall_steps")}
    named = f"this repo {mode}" + (f" (root {plan.root})" if plan.root != ROOTS[0] else "")  # --root's rows apart
    return make_row(plan, named, status, timed, (r.get("perf/peak_allocated_mib"),
                    r.get("perf/peak_reserved_mib")), train_logged(outcome.get("run_dir"), plan.total_steps),
                    peak_tflops, outcome.get("run_dir"), profile, repeat=repeat, launched_at=launched_at,
                    ended_at=train_logged(outcome.get("run_dir"), plan.total_steps, "time"))


def train_logged(run_dir: Optional[str], last_step: int, key: str = "train/loss") -> List[Optional[float]]:
    """``key`` of the training rows at each step from 1 to ``last_step`` in the run's metrics.jsonl
    (train.log_every=1; None for a step it lacks): the loss, as torchtitan's side gives every step's, so that two
    runs' curves lie side by side; or ``time``, the host's clock when the step's metrics were read (a sync)."""
    if not run_dir or not (Path(run_dir) / "metrics.jsonl").is_file():
        return []
    by_step = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "train/loss" in row:
            by_step[row["step"]] = row.get(key)
    return [by_step.get(step) for step in range(1, last_step + 1)]


COLUMNS = [("size", "size", "{}"), ("run", "run", "{}"), ("tokens", "tokens per GPU per step", "{}"),
           ("ac", "AC", "{}"), ("alloc_conf", "allocator", "{}"), ("reshard", "FSDP2 reshard", "{}"),
           ("float8", "matmuls", "{}"),
           ("tokens_per_s_per_gpu", "tokens/s per GPU", "{:,.0f}"), ("mfu_pct", "MFU", "{:.1f}%"),
           ("step_ms_median", "step ms median", "{:,.1f}"), ("step_ms_p90", "step ms p90", "{:,.1f}"),
           ("peak_allocated_mib", "peak allocated MiB per GPU", "{:,.0f}"),
           ("peak_reserved_mib", "peak reserved MiB per GPU", "{:,.0f}"),
           ("vs_torchtitan_best", "tokens/s vs torchtitan's best", "{:.3f}x"),
           ("vs_range", "over the pairs", "{}"),
           ("reserved_vs_torchtitan_best", "reserved vs its", "{:.2f}x"),
           ("scaling_efficiency", "scaling efficiency", "{:.0%}"),
           ("loss_first", "loss, step 1", "{:.3f}"), ("loss_last", "loss, last step", "{:.3f}"),
           ("time_to_loss_s", "time to loss s", "{:,.0f}"),
           ("status", "status", "{}")]
# Shown only where some row has a value: repeats, a strong-scaling series, time to loss.
OPTIONAL_COLUMNS = ("vs_range", "scaling_efficiency", "time_to_loss_s")


def shown(row: Dict[str, Any], key: str) -> Any:
    """What ``row`` shows in ``key``'s column: its own value, the tokens per GPU per step as sequence x sequences,
    the matmuls' precision, and for a row from before resharding was a setting, the default it ran with."""
    if key == "tokens":
        return f"{row['seq_len']} x {row['local_batch']}"
    if key == "float8":  # a row from before --float8 ran in bf16
        return "float8 (tensorwise)" if row.get("float8") else "bf16"
    if key == "vs_range":
        low_high = row.get("vs_range")
        return f"{low_high[0]:.3f}-{low_high[1]:.3f}x ({row.get('pairs')} pairs)" if low_high else None
    return reshard_of(row) if key == "reshard" else row.get(key)


def reshard_of(row: Dict[str, Any]) -> str:
    """``row``'s FSDP2 resharding; a row from before it was a setting ran with the default."""
    return row.get("reshard", RESHARDS[0])


def matched_key(row: Dict[str, Any]) -> Tuple:
    """The rows that ran the same thing: one size, GPU count, tokens per GPU, activation checkpointing, CUDA
    allocator, FSDP2 resharding, float8 and initial weights (a row from before a setting existed ran with what is
    now its default)."""
    return (row["size"], row["nproc"], row["seq_len"], row["local_batch"], row["ac"], row.get("alloc_conf"),
            reshard_of(row), bool(row.get("float8", False)), bool(row.get("matched_init", False)))


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _final_mean(losses: Sequence[Optional[float]], window: int = 10) -> Optional[float]:
    tail = [v for v in losses[-window:] if v is not None]
    return sum(tail) / len(tail) if len(tail) == window else None


def with_time_to_loss(runs: Sequence[Dict[str, Any]], window: int = 10) -> List[Dict[str, Any]]:
    """Each run with ``time_to_loss_s``: from its launch to the end of the first step at which the mean loss of
    the last ``window`` steps is at or below the target of its matched runs (``matched_key``, every side and
    repeat): the highest of their final ``window``-step means, so that every run gets there. Start-up, compile
    and capture count. None without a clock for each step or without a run to compare with."""
    finals: Dict[Tuple, List[float]] = {}
    for row in runs:
        final = _final_mean(row.get("losses") or [], window)
        if final is not None:
            finals.setdefault(matched_key(row), []).append(final)
    out = []
    for row in runs:
        target = max(finals.get(matched_key(row), []), default=None)
        losses, ended, began = row.get("losses") or [], row.get("step_ended_at") or [], row.get("launched_at")
        seconds = None
        if target is not None and began is not None and len(finals[matched_key(row)]) > 1:
            for step in range(window, min(len(losses), len(ended)) + 1):
                recent = losses[step - window:step]
                if None not in recent and ended[step - 1] is not None and sum(recent) / window <= target:
                    seconds = ended[step - 1] - began
                    break
        out.append({**row, "time_to_loss_s": seconds, "loss_target": target})
    return out


def combined(runs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per run and settings out of its ``--repeats``: the median of the repeats' tokens/s, step times and
    time to loss, the highest peak memory, the first repeat's losses, and every repeat's own numbers under
    ``repeats`` (the pairs' ratios come from those). A single run stays as it is."""
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for row in runs:
        groups.setdefault((row["run"], *matched_key(row)), []).append(row)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        group = sorted(group, key=lambda r: r.get("repeat", 0))
        ok = [r for r in group if r["status"].startswith("ok")]
        row = dict(ok[0] if ok else group[0])
        for key in ("tokens_per_s_per_gpu", "mfu_pct", "step_ms_median", "step_ms_p90", "step_ms_mean",
                    "time_to_loss_s"):
            row[key] = _median([r.get(key) for r in ok])
        for key in ("peak_allocated_mib", "peak_reserved_mib"):
            row[key] = max((r[key] for r in ok if r.get(key) is not None), default=None)
        failed = [r for r in group if not r["status"].startswith("ok")]
        row["status"] = "ok" if not failed else f"{len(ok)} of {len(group)} ok; {failed[0]['status']}"
        row["repeats"] = [{k: r.get(k) for k in ("repeat", "tokens_per_s_per_gpu", "step_ms_median",
                                                 "peak_reserved_mib", "loss_last", "time_to_loss_s", "status",
                                                 "run_dir")} for r in group]
        out.append(row)
    return out


def with_ratios(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``rows`` with each run's tokens/s and peak reserved memory over those of torchtitan's fastest run at the
    same settings (``matched_key``), the issue's yardstick; None where there is no such run or no number. Rows
    of ``--repeats`` also get the range of the ratio over the pairs: repeat i's tokens/s over the best of
    torchtitan's runs of repeat i (they ran next to each other)."""
    best: Dict[Tuple, Dict[str, Any]] = {}
    best_of_repeat: Dict[Tuple, float] = {}
    for row in rows:
        if row["run"].startswith("torchtitan") and row.get("tokens_per_s_per_gpu"):
            key = matched_key(row)
            if key not in best or row["tokens_per_s_per_gpu"] > best[key]["tokens_per_s_per_gpu"]:
                best[key] = row
            for r in row.get("repeats") or []:
                if r.get("tokens_per_s_per_gpu"):
                    pair = (*key, r["repeat"])
                    best_of_repeat[pair] = max(best_of_repeat.get(pair, 0.0), r["tokens_per_s_per_gpu"])
    out = []
    for row in rows:
        top = best.get(matched_key(row))
        ratio = lambda k: (row[k] / top[k]) if top and row.get(k) and top.get(k) else None  # noqa: E731
        pairs = [r["tokens_per_s_per_gpu"] / best_of_repeat[(*matched_key(row), r["repeat"])]
                 for r in row.get("repeats") or []
                 if r.get("tokens_per_s_per_gpu") and (*matched_key(row), r["repeat"]) in best_of_repeat]
        out.append({**row, "vs_torchtitan_best": ratio("tokens_per_s_per_gpu"),
                    "reserved_vs_torchtitan_best": ratio("peak_reserved_mib"),
                    "vs_range": [min(pairs), max(pairs)] if pairs and not row["run"].startswith("torchtitan") else None,
                    "pairs": len(pairs)})
    return out


def with_scaling(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each row of a strong-scaling series with its efficiency: its tokens/s per GPU over the same run's on one
    GPU at the same global batch (sequences per step over all GPUs) and otherwise the same settings."""
    def series(row: Dict[str, Any]) -> Tuple:
        key = list(matched_key(row))
        key[1:4] = [row["seq_len"], row["nproc"] * row["local_batch"]]  # GPUs and split out: the global batch stays
        return (row["run"], *key)

    one_gpu = {series(r): r["tokens_per_s_per_gpu"] for r in rows if r["nproc"] == 1 and r.get("tokens_per_s_per_gpu")}
    return [{**row, "scaling_efficiency": (row["tokens_per_s_per_gpu"] / one_gpu[series(row)]
                                           if row.get("tokens_per_s_per_gpu") and series(row) in one_gpu
                                           and any(r["nproc"] > 1 and series(r) == series(row) for r in rows)
                                           else None)} for row in rows]


def table_order(row: Dict[str, Any]) -> Tuple:
    """Where ``row`` goes in the table: by size, then the settings of ``matched_key`` (the most tokens first), then
    torchtitan's runs before this repo's, each side's in the order of its variants."""
    sizes, runs = list(SHAPES), [f"torchtitan {v}" for v in THEIRS] + [f"this repo {m}" for m in OURS]
    return (sizes.index(row["size"]) if row["size"] in sizes else len(sizes), row["nproc"],
            -row["seq_len"] * row["local_batch"], row["ac"], row.get("alloc_conf") or "",
            reshard_of(row), runs.index(row["run"]) if row["run"] in runs else len(runs))


def cell(value: Any, form: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return form.format(value).replace("|", "\\|")


def report(rows: Sequence[Dict[str, Any]], run_plans: Sequence[Plan], device: str,
           peak: Optional[Tuple[str, float]]) -> str:
    """The Markdown that is printed and saved: the table, then what its numbers are."""
    nprocs = sorted({row["nproc"] for row in rows}) or [p.nproc for p in run_plans[:1]]
    columns = [c for c in COLUMNS if c[0] not in OPTIONAL_COLUMNS or any(shown(row, c[0]) is not None for row in rows)]
    lines = [f"## torchtitan {TORCHTITAN} against this repo: Llama 3 on {'/'.join(map(str, nprocs))} x {device}", "",
             markdown_table([header for _, header, _ in columns],
                            [[cell(shown(row, key), form) for key, _, form in columns] for row in rows]), ""]
    described = []
    for row in rows:  # one line per shape and tokens per step in the table (an --append'ed table holds several)
        what = (row["size"], row["seq_len"], row["local_batch"])
        if what in described or row["size"] not in SHAPES:
            continue
        described.append(what)
        s, flops = SHAPES[row["size"]], training_flops_per_token(SHAPES[row["size"]], row["seq_len"])
        timed = [(r.get("warmup_steps"), r["steps_timed"]) for r in rows
                 if (r["size"], r["seq_len"], r["local_batch"]) == what and r.get("warmup_steps") and r.get("steps_timed")]
        steps = f"; {timed[0][0]} untimed steps, then {timed[0][1]} timed" if timed else ""
        lines.append(f"- `{s.name}`: {s.layers} layers x {s.dim}, {s.heads} heads / {s.kv_heads} KV heads, FFN "
                     f"{s.ffn_hidden}, vocabulary {s.vocab}, RoPE theta {s.rope_theta:g}: {parameter_count(s):,} "
                     f"parameters; {flops / 1e9:.2f} GFLOP per token at {row['seq_len']} tokens; "
                     f"{row['seq_len']} x {row['local_batch']} tokens per GPU per step{steps}.")
    peak_text = f"{peak[0]}, {peak[1]:g} TFLOP/s (trainer/metrics/perf.py)" if peak else "no known peak for this GPU: no MFU"
    lines += ["", "FLOPs per token = 6 x (parameters - token embedding) + 12 x layers x width x sequence length, "
              f"one formula for both sides (scripts/lib/llama3.py); MFU against {peak_text}. tokens/s per GPU = "
              "tokens per GPU per step x timed steps / their wall window (the first timed step's start to the "
              "last one's end, whatever ran between included: trainer/metrics/perf.py WallWindow, both sides; "
              f"both read their loss on the host every {LOG_EVERY} step{'s' * (LOG_EVERY > 1)}). Step times: the "
              "interval between step ends (graphing.StepTimer) over the timed steps, a metric read left out. "
              "Memory: rank 0's GPU, the peak over the whole run. "
              "The two ratios: this row's tokens/s and peak reserved memory over those of torchtitan's fastest run "
              "with the same size, GPUs, tokens, activation checkpointing, allocator and resharding. allocator: "
              "PYTORCH_CUDA_ALLOC_CONF of both sides' processes (—: torch's default). FSDP2 reshard: after-forward "
              "(each side's default) or never. Losses: the mean over all GPUs' tokens."
              + (" Repeats: each row is the median of its runs (the sides' runs alternating: torchtitan's, then this "
                 "repo's, then again); over the pairs: the lowest and highest of repeat i's tokens/s over torchtitan's "
                 "best of repeat i; peak memory: the highest of the runs." if any(r.get("repeats") for r in rows) else "")
              + (" Time to loss: from the launch (start-up, compile and capture included) to the end of the first "
                 "step at which the mean loss of the last 10 steps is at or below the highest of the matched runs' "
                 "final 10-step means; each step's end on the host's clock (both sides read the host each step)."
                 if any(r.get("time_to_loss_s") is not None for r in rows) else "")
              + (" Scaling efficiency: tokens/s per GPU over the same run's on one GPU at the same global batch "
                 "(--strong-scaling)." if any(r.get("scaling_efficiency") is not None for r in rows) else ""), ""]
    for plan in run_plans[:1]:
        matched = [list(m) for m in matched_settings(plan)]
        if len({row["size"] for row in rows}) > 1:  # an --append'ed table: the sizes' lines above say each shape
            matched = [m if m[0] not in ("model", "shape") else
                       [m[0], "torchtitan Transformer, TransformerModelArgs of each size above" if m[0] == "model"
                        else "each size's, above", m[2]] for m in matched]
        # An --append'ed table may hold several settings: where rows differ, the setting is each row's, the same on
        # both sides of a matched pair.
        per_row = {"activation checkpointing": (lambda r: r["ac"], [
                       "activation_checkpoint.mode = the AC column: full (every block) or none",
                       "train.activation_checkpointing=true (every block) or false, the same"]),
                   "tokens per GPU per step": (lambda r: (r["seq_len"], r["local_batch"]), [
                       "the tokens column: sequence length x sequences per GPU",
                       "recipe.model.context x recipe.data.batch_size, the same"]),
                   "steps": (lambda r: (r.get("warmup_steps"), r.get("steps_timed")), [
                       "each size's, above", "the same (11 eager + capture of them untimed)"]),
                   "CUDA allocator": (lambda r: r.get("alloc_conf"), [
                       "the allocator column: PYTORCH_CUDA_ALLOC_CONF", "the same"]),
                   "initial weights": (lambda r: bool(r.get("matched_init")), [
                       "init_weights, or with --matched-init redrawn as transformers draws (N(0, 0.02), norms 1)",
                       "transformers' LlamaForCausalLM init (N(0, 0.02), norms 1)"]),
                   "sharding": (reshard_of, [
                       "parallelize_llama: FSDP2 over every GPU, resharded as the FSDP2 reshard column says; built on "
                       "the meta device, each rank drawing its shards",
                       "train.parallel=fsdp2, train.fsdp.reshard_after_forward as that column says, "
                       "train.fsdp.init=meta"])}
        for setting, (of_row, words) in per_row.items():
            if len({of_row(row) for row in rows if row.get("steps_timed") or setting != "steps"}) > 1:
                matched = [m if not m[0].startswith(setting) else [setting, *words] for m in matched]
        lines += [markdown_table(["matched", "torchtitan", "this repo"], matched)]
    return "\n".join(lines + profile_report(rows)) + "\n"


def profile_report(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Where each profiled run's step goes on rank 0's GPU (``--profile``), one table per set of matched runs:
    milliseconds per step by kind of kernel (scripts/lib/kernel_profile.py), both sides read alike."""
    from scripts.lib.kernel_profile import KINDS, OTHER

    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for row in rows:
        if row.get("profile"):
            groups.setdefault(matched_key(row), []).append(row)
    lines: List[str] = []
    for (size, nproc, seq_len, batch, ac, alloc, reshard, float8, _), runs in groups.items():
        kinds = [{k["kind"]: k["ms_per_step"] for k in run["profile"].get("kinds", [])} for run in runs]
        ms = lambda value: cell(value, "{:,.2f}")  # noqa: E731
        table = [["step (timed, no profiler)", *(ms(run.get("step_ms_mean")) for run in runs)],
                 ["GPU busy (a kernel running)", *(ms(run["profile"].get("gpu_busy_ms")) for run in runs)],
                 ["GPU idle", *(ms(run["profile"].get("idle_ms")) for run in runs)]]
        for kind in [k for k, _ in KINDS] + [OTHER]:
            if any(kind in found for found in kinds):
                table.append([kind, *(ms(found.get(kind, 0.0)) for found in kinds)])
        table.append(["collectives beside compute", *(ms(run["profile"].get("collective_beside_compute_ms"))
                                                      for run in runs)])
        table.append(["kernels per step", *(cell(run["profile"].get("gpu_ops_per_step"), "{:,.0f}") for run in runs)])
        pools = [next((p for p in run["profile"].get("memory_pools", []) if p["graph"]), None) for run in runs]
        if any(pools):  # scripts/profile_step.py --memory: what the graph's pool reserved against what it ever held
            table.append(["graph pool MiB: reserved / most live at once",
                          *(f"{p['reserved_mib']:,.0f} / {p['peak_live_mib']:,.0f}" if p else "—" for p in pools)])
        lines += ["", f"Where a step goes, {size}, AC {ac}, {nproc} GPUs, {seq_len} x {batch} tokens per GPU"
                  f"{f', {alloc}' if alloc else ''}{', never resharded' if reshard == 'never' else ''}"
                  f"{', float8' if float8 else ''}: ms per step "
                  "on rank 0's GPU over "
                  f"{'/'.join(str(run['profile'].get('steps', '?')) for run in runs)} profiled steps (kernel kinds "
                  "by name, scripts/lib/kernel_profile.py; kinds overlap in time across streams, so they sum to more "
                  "than the busy time)", "",
                  markdown_table(["ms per step", *(run["run"] for run in runs)], table)]
    return lines


# ---- running ---------------------------------------------------------------------------

def plan_folder(plan: Plan, runs: Path, repeat: int, repeats: int) -> Path:
    """Where one run of ``plan`` goes: by size, then GPU count, tokens and every setting that changes a run (a
    strong-scaling series holds several GPU counts; calls that share ``--runs`` keep each other's runs), then by
    repeat where there are several."""
    settings = [f"ac-{plan.ac}", *(["float8"] if plan.float8 else []),
                *([f"reshard-{plan.reshard}"] if plan.reshard != RESHARDS[0] else []),
                *([f"root-{plan.root}"] if plan.root != ROOTS[0] else []),
                *(["matched-init"] if plan.matched_init else []),
                *([] if plan.alloc_conf == TORCHTITAN_ALLOC_CONF else
                  ["alloc-" + ("".join(c if c.isalnum() else "-" for c in plan.alloc_conf) or "default")])]
    folder = runs / plan.shape.name / "_".join([f"{plan.nproc}gpu", f"{plan.seq_len}x{plan.local_batch}", *settings])
    return folder / f"repeat{repeat + 1}" if repeats > 1 else folder


def run_theirs(plan: Plan, variant: str, folder: Path, timeout: float,
               profile_steps: int = 0) -> Tuple[Optional[Dict[str, Any]], str, str]:
    """One torchtitan run under ``folder``: (its result, status, its directory)."""
    folder = folder / f"torchtitan_{variant}"
    folder.mkdir(parents=True, exist_ok=True)
    result_file = folder / "result.json"
    cmd = theirs_command(plan, variant, result_file, deadline_s=timeout, profile_steps=profile_steps)
    (folder / "command.txt").write_text(shlex.join(cmd) + "\n")
    stdout, stderr, code = run_captured(cmd, timeout + 120, env={"PYTHONUNBUFFERED": "1"})
    (folder / "stdout.log").write_text(stdout)
    (folder / "stderr.log").write_text(stderr)
    if code is None:
        return None, f"timed out after {timeout + 120:g} s", str(folder)
    if code != 0 or not result_file.is_file():
        return None, f"failed (exit {code}): {failure_line(stderr)}", str(folder)
    return json.loads(result_file.read_text()), "ok", str(folder)


def profile_ours(plan: Plan, mode: str, args: argparse.Namespace, folder: Path) -> Optional[Dict[str, Any]]:
    """This repo's side in ``mode``, profiled (``profile_command``): what scripts/profile_step.py found, or None
    (said, with the reason) when the run failed: a profile is an extra, the table's row stands without it."""
    folder = folder / "profiles" / mode
    folder.mkdir(parents=True, exist_ok=True)
    cmd = profile_command(plan, mode, args, folder)
    (folder / "command.txt").write_text(shlex.join(cmd) + "\n")
    print(f"{SCRIPT}: [{plan.shape.name}] this repo {mode}: profiling {args.profile} steps", flush=True)
    stdout, stderr, code = run_captured(cmd, args.timeout, env={"PYTHONUNBUFFERED": "1"})
    (folder / "stdout.log").write_text(stdout)
    (folder / "stderr.log").write_text(stderr)
    if code != 0 or not (folder / "profile.json").is_file():
        why = f"ran past {args.timeout} s" if code is None else f"exit {code}: {failure_line(stderr)}"
        print(f"{SCRIPT}: [{plan.shape.name}] this repo {mode}: no profile ({why})", flush=True)
        return None
    return {"steps": args.profile, **json.loads((folder / "profile.json").read_text())}


def torchtitan_version() -> str:
    """torchtitan's version, once its Llama 3 model imports (in a child: no torch in this process yet);
    refuses (exit 2) with how to install it otherwise. Runs before anything looks for CUDA."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        refuse(f"{SCRIPT}: --theirs runs torchtitan, which this Python ({sys.executable}) cannot import: {INSTALL}. "
               "(--theirs none runs this repo's side alone; --dry-run shows both sides' commands.)")
    code = "import torchtitan, torchtitan.models.llama3; print(torchtitan.__version__)"
    stdout, stderr, status = run_captured([sys.executable, "-c", code], 600)
    if status != 0:
        refuse(f"{SCRIPT}: torchtitan is installed but its Llama 3 model does not import "
               f"({failure_line(stderr)}): {INSTALL}")
    found = stdout.strip().splitlines()[-1] if stdout.strip() else "?"
    if found != TORCHTITAN:
        print(f"{SCRIPT}: warning: torchtitan {found} is installed; the shapes and settings here were read from "
              f"{TORCHTITAN} (the worker checks the shape it builds)", file=sys.stderr, flush=True)
    return found


def merged(rows: List[Dict[str, Any]], kept: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``rows`` after the rows an earlier call wrote (``kept``, from ``check_append``) that they do not replace."""
    key = lambda row: (row["run"], *matched_key(row))  # noqa: E731
    fresh = {key(row) for row in rows}
    return [row for row in kept if key(row) not in fresh] + rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = Parser(prog=SCRIPT, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="train.py's overrides given here go to this repo's runs, after the script's own settings\n"
                           "(those are refused as overrides: they keep the two sides matched).")
    parser.add_argument("--size", choices=("8b", "1b", "both"), default="both", help="which shape (default both)")
    parser.add_argument("--nproc", type=int, default=None, help="GPUs, one process each (default: every GPU)")
    parser.add_argument("--seq-len", type=positive_int, default=8192, help="tokens per sequence (default 8192)")
    parser.add_argument("--local-batch", type=positive_int, default=1, help="sequences per GPU per step (default 1)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per run (default 20)")
    parser.add_argument("--warmup-steps", type=positive_int, default=OUR_WARMUP,
                        help=f"untimed steps before them, at least {OUR_WARMUP}: this repo's 11 eager steps and its "
                             f"capture (default {OUR_WARMUP})")
    parser.add_argument("--ours", type=variants(OURS, "--ours"), default=list(OURS),
                        help="this repo's graph modes: full, full_compiled, or none (default both)")
    parser.add_argument("--theirs", type=variants(THEIRS, "--theirs"), default=list(THEIRS),
                        help="torchtitan's runs: eager, compiled (compile.enable), or none (default both)")
    parser.add_argument("--ac", choices=("auto", "none", "full"), default="auto",
                        help="activation checkpointing on both sides (default auto: full for 8b, none for 1b)")
    parser.add_argument("--seed", type=int, default=0, help="of the data and the weights, both sides (default 0)")
    parser.add_argument("--output", type=Path, default=None,
                        help="the table's JSON (default scripts/results/torchtitan_<N>gpu.json; .md beside it)")
    parser.add_argument("--runs", type=Path, default=None,
                        help="every run's directory and logs (default outputs/bench_torchtitan/<timestamp>)")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of an existing --output that this call does not rerun (refused when they "
                             "were measured at another commit, with other versions or on another GPU)")
    parser.add_argument("--timeout", type=positive_int, default=1800, help="seconds one run may take (default 1800)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N steps of each run (torchtitan's after its timed steps, this repo's in a "
                             "scripts/profile_step.py run of its own) and add where each step's GPU time goes")
    parser.add_argument("--reshard", choices=RESHARDS, default=RESHARDS[0],
                        help="FSDP2 on both sides: blocks resharded after forward (default: each side's default) "
                             "or never (weights stay gathered from forward to backward: less communication, more "
                             "memory)")
    parser.add_argument("--float8", action="store_true",
                        help="tensorwise float8 matmuls with FSDP2's float8 all-gather on both sides: torchtitan's "
                             "float8 converter (its docs/float8.md settings, the output layer left out) against "
                             "train.float8=tensorwise train.fsdp.float8_all_gather=true (docs/float8.md)")
    parser.add_argument("--root", choices=ROOTS, default=ROOTS[0],
                        help="this repo's train.fsdp.root: the embeddings, final norm and head resharded after forward "
                             "(default), kept gathered, or split as torchtitan does (the embedding apart, resharded; "
                             "the rest gathered); its rows are named by it and compared with the same torchtitan runs")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs per side and setting, alternating (torchtitan's, this repo's, again): each row the "
                             "median of its runs, the ratio with its range over the pairs (default 1)")
    parser.add_argument("--matched-init", action="store_true",
                        help="torchtitan's weights drawn as transformers' Llama draws this repo's (every Linear and "
                             "embedding weight N(0, 0.02), norms 1), so that the two loss curves can be compared")
    parser.add_argument("--strong-scaling", action="store_true",
                        help="one global batch (--global-batch sequences a step) on 1, 2, 4, ... GPUs up to --nproc, "
                             "both sides: tokens/s per GPU and scaling efficiency")
    parser.add_argument("--global-batch", type=positive_int, default=None,
                        help=f"sequences a step over all GPUs, with --strong-scaling (default {GLOBAL_BATCH})")
    parser.add_argument("--alloc-conf", default=TORCHTITAN_ALLOC_CONF,
                        help="PYTORCH_CUDA_ALLOC_CONF for both sides (default: torchtitan's launcher's, "
                             f"{TORCHTITAN_ALLOC_CONF!r}; '' for torch's default allocator)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print both sides' commands and the matched settings, run nothing (no GPU needed)")
    # A bad option, then a typo in train.py's part, fail here, once: the part composed with this repo's side's
    # settings (no torch imported).
    def checked_defaults(a: argparse.Namespace) -> List[str]:
        check(parser, a)
        return ours_overrides(plans(a, a.nproc or 1)[0])

    args, _ = script_config(parser, argv, defaults=checked_defaults)
    if args.dry_run:
        return dry_run(args)
    version = torchtitan_version() if args.theirs else None  # before CUDA: the install line, on any machine
    gpus = cuda_device_count()
    if gpus == 0:
        refuse(f"{SCRIPT}: both sides train on CUDA GPUs and this machine has none (--dry-run prints what would run)")
    nproc = args.nproc or gpus
    if nproc > gpus:
        refuse(f"{SCRIPT}: --nproc {nproc}: this machine has {gpus} CUDA GPU{'s' * (gpus > 1)}")
    return run(args, plans(args, nproc), version)


def check(parser: Parser, args: argparse.Namespace) -> None:
    """Refuses (one line, exit 2) what cannot run or would break the match."""
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: must be at least 1")
    if args.warmup_steps < OUR_WARMUP:
        parser.error(f"--warmup-steps {args.warmup_steps}: must be at least {OUR_WARMUP} (this repo's 11 eager "
                     "warm-up steps and its capture; torchtitan gets as many, so both train as many steps)")
    if not args.ours and not args.theirs:
        parser.error("--ours none and --theirs none: nothing to run")
    if args.profile < 0:
        parser.error(f"--profile {args.profile}: a number of steps, 0 for no profile")
    if args.global_batch is not None and not args.strong_scaling:
        parser.error("--global-batch is the batch of a --strong-scaling series: add --strong-scaling, or set "
                     "--local-batch for one GPU count")
    if args.strong_scaling:
        if args.local_batch != 1:
            parser.error("--strong-scaling splits --global-batch over the GPUs: drop --local-batch")
        if args.nproc == 1:
            parser.error("--strong-scaling with --nproc 1 is a single run: give --nproc 2 or more")
    for override in args.overrides:
        key = override_key(override)
        if key in SETS or any(key == s or key.startswith(s + ".") for s in SETS_UNDER):
            parser.error(f"{override!r} is set by this script to match torchtitan's side: drop it")


def dry_run(args: argparse.Namespace) -> int:
    nproc = args.nproc or max(cuda_device_count(), 1)
    runs = (args.runs or ROOT / "outputs" / "bench_torchtitan" / "<timestamp>").resolve()
    output = args.output or ROOT / "scripts" / "results" / f"torchtitan_{nproc}gpu.json"
    run_plans = plans(args, nproc)
    kept = check_append(SCRIPT, output, provenance(None)) if args.append else []  # refused as a real call would be
    appended = f" after the {len(kept)} rows it holds (--append)" if args.append else ""
    print(f"{SCRIPT} --dry-run: {nproc} GPU{'s' * (nproc > 1)}; runs under {runs}; table to {output}{appended}\n")
    for plan in run_plans:
        s = plan.shape
        print(f"[{s.name}] {s.layers} x {s.dim}, {s.heads}/{s.kv_heads} heads, FFN {s.ffn_hidden}, vocab {s.vocab}: "
              f"{parameter_count(s):,} parameters, {plan.flops_per_token:,.0f} FLOPs per token at {plan.seq_len}; "
              f"activation checkpointing {plan.ac}; {plan.nproc} GPU{'s' * (plan.nproc > 1)}, "
              f"{plan.seq_len} x {plan.local_batch} tokens per GPU per step")
        for repeat in range(args.repeats):
            folder = plan_folder(plan, runs, repeat, args.repeats)
            again = f" (repeat {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
            for variant in args.theirs:
                cmd = theirs_command(plan, variant, folder / f"torchtitan_{variant}" / "result.json", args.timeout,
                                     args.profile)
                print(f"{s.name} torchtitan {variant}{again}: {shlex.join(cmd)}")
            for mode in args.ours:
                cmd = command(mode, plan.nproc, ours_args(plan, args), folder / "runs" / mode, group_of(plan),
                              group_of(plan))
                print(f"{s.name} this repo {mode}{again}: {shlex.join(cmd)}")
                if args.profile and repeat == 0:
                    cmd = profile_command(plan, mode, args, folder / "profiles" / mode)
                    print(f"{s.name} this repo {mode}, profiled: {shlex.join(cmd)}")
        print()
    print(markdown_table(["matched", "torchtitan", "this repo"], [list(m) for m in matched_settings(run_plans[0])]))
    return 0


def run(args: argparse.Namespace, run_plans: List[Plan], version: Optional[str]) -> int:
    import torch  # after the checks: --help, bad input and the refusals answer without it

    from trainer.metrics.perf import peak_tflops

    exit_on_sigterm()  # a SIGTERM stops the run in flight (scripts/lib/launch.py) on the way out
    if args.alloc_conf:  # both sides' processes inherit it
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    device = torch.cuda.get_device_name(0)
    peak = peak_tflops(device, "bf16")
    nproc = run_plans[0].nproc
    runs = (args.runs or ROOT / "outputs" / "bench_torchtitan" / timestamp()).resolve()
    output = (args.output or ROOT / "scripts" / "results" / f"torchtitan_{nproc}gpu.json").resolve()
    measured = provenance(device)
    kept = check_append(SCRIPT, output, measured) if args.append else []  # refused before anything runs
    print(f"{SCRIPT}: {nproc} x {device}, torch {torch.__version__}, torchtitan {version or '(not run)'}, commit "
          f"{measured['commit']}; runs under {runs}", flush=True)
    rows: List[Dict[str, Any]] = []
    tflops = peak[1] if peak else None
    for plan in run_plans:
        for repeat in range(args.repeats):  # alternating: theirs, ours, theirs, ours, ...
            folder = plan_folder(plan, runs, repeat, args.repeats)
            for variant in args.theirs:
                launched_at = time.time()
                result, status, where = run_theirs(plan, variant, folder, args.timeout,
                                                   args.profile if repeat == 0 else 0)
                rows.append(theirs_row(plan, variant, result, status, tflops, where, repeat=repeat,
                                       launched_at=launched_at))
                say(rows[-1])
            for mode in args.ours:
                print(f"{SCRIPT}: [{plan.shape.name}] this repo {mode}: running", flush=True)
                launched_at = time.time()
                outcome = launch_mode(mode, plan.nproc, ours_args(plan, args), folder, group=group_of(plan),
                                      run_name=group_of(plan), timeout=args.timeout, cuda=True)
                profile = profile_ours(plan, mode, args, folder) if args.profile and repeat == 0 else None
                rows.append(ours_row(plan, mode, outcome, tflops, profile, repeat=repeat, launched_at=launched_at))
                say(rows[-1])
    fresh = with_provenance(combined(with_time_to_loss(rows)), measured)
    table_rows = sorted(with_scaling(with_ratios(merged(fresh, kept))), key=table_order)
    text = report(table_rows, run_plans, device, peak) + "\n" + provenance_line(measured) + "\n"
    text += loss_plots(table_rows, output)
    print("\n" + text)
    output.parent.mkdir(parents=True, exist_ok=True)
    sizes = json.loads(output.read_text()).get("sizes", {}) if args.append and output.is_file() else {}
    for p in run_plans:  # keyed by shape and activation checkpointing: an --append'ed table may hold both of 8b's
        sizes[f"{p.shape.name}, ac {p.ac}"] = {
            "shape": vars(p.shape), "parameters": parameter_count(p.shape), "flops_per_token": p.flops_per_token,
            "seq_len": p.seq_len, "local_batch": p.local_batch, "ac": p.ac, "nproc": p.nproc,
            "warmup_steps": p.warmup_steps, "steps": p.steps, "train_args": ours_args(p, args)}
    write_json(output, {"device": device, "torch": torch.__version__, "torchtitan": version, "peak": peak,
                        "provenance": measured,
                        "sizes": sizes, "matched": [list(m) for m in matched_settings(run_plans[0])], "rows": table_rows})
    output.with_suffix(".md").write_text(text)
    print(f"wrote {output} and {output.with_suffix('.md').name}; runs in {runs}")
    return exit_status(SCRIPT, [(f"[{row['size']}] {row['run']}", row["status"]) for row in rows])


def loss_plots(rows: Sequence[Dict[str, Any]], output: Path) -> str:
    """One PNG per matched set of runs (``matched_key``) with more than one curve, beside ``output``: every run's
    loss at each step, laid over each other (scripts/lib/loss_plot.py); the Markdown lines that name them and say
    which colour is which run."""
    from scripts.lib.loss_plot import write_loss_plot

    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for row in rows:
        if any(v is not None for v in row.get("losses") or []):
            groups.setdefault(matched_key(row), []).append(row)
    lines = []
    for key, group in groups.items():
        if len(group) < 2:
            continue
        size, nproc, seq_len, local_batch = key[:4]
        name = (f"{output.stem}_loss_{size}_{nproc}gpu_{seq_len}x{local_batch}_{group[0]['ac']}"
                f"{'_float8' if key[7] else ''}{'_matched_init' if key[8] else ''}.png")
        drawn = write_loss_plot(output.with_name(name), [(row["run"], row["losses"]) for row in group])
        colours = ", ".join(f"{colour}: {run}" for run, colour in drawn["colours"].items())
        lines.append(f"- `{name}`: {size} on {nproc} GPUs, {seq_len} x {local_batch} tokens per GPU"
                     f"{', float8' if key[7] else ''}{', matched initial weights' if key[8] else ''}; {colours}; "
                     f"steps {drawn['steps'][0]}-{drawn['steps'][1]}, loss {drawn['loss'][0]:.2f} (bottom) to "
                     f"{drawn['loss'][1]:.2f} (top)")
    return ("\nLoss curves (every step of each run; with --repeats, its first):\n\n" + "\n".join(lines) + "\n"
            if lines else "")


def say(row: Dict[str, Any]) -> None:
    """Each run's numbers as they come: a machine taken away mid-benchmark still leaves them in the log."""
    numbers = ""
    if row["tokens_per_s_per_gpu"] is not None:
        numbers = (f": {row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {cell(row['mfu_pct'], '{:.1f}%')}, "
                   f"step {cell(row['step_ms_median'], '{:,.1f}')} ms median, loss {cell(row['loss_first'], '{:.3f}')}"
                   f" -> {cell(row['loss_last'], '{:.3f}')}, peak reserved {cell(row['peak_reserved_mib'], '{:,.0f}')} MiB")
    print(f"{SCRIPT}: [{row['size']}] {row['run']}: {row['status']}{numbers}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
