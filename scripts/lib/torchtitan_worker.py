"""torchtitan's side of scripts/bench_torchtitan.py: one process per GPU under torchrun, started by that script.

    python -m torch.distributed.run --standalone --nproc_per_node=N -m scripts.lib.torchtitan_worker \
        --size 8b --seq-len 8192 --local-batch 1 --warmup-steps 12 --steps 20 --ac full [--compile] --output FILE

It builds torchtitan's own Llama 3 model (``torchtitan.models.llama3``: the ``8B`` flavour's TransformerModelArgs,
or for ``1b`` the same args at the smaller width and depth of scripts/lib/llama3.py), on the meta device in fp32
as torchtitan's trainer does, checks its parameter count and FLOPs per token against scripts/lib/llama3.py, and
hands it to torchtitan's ``parallelize_llama`` with a JobConfig holding torchtitan's Llama 3 settings:
activation checkpointing (``full`` or ``none``), per-block ``torch.compile`` with the loss compiled too
(``--compile``), FSDP2 over every rank with bf16 parameters and fp32 gradient reduction, resharding after
forward (``--reshard default``, its default) or never (``--reshard never``); with ``--float8``, its float8
converter (tensorwise, FSDP2 float8 all-gather, the output layer left out) swaps the Linear layers on the meta
model before sharding, and the scales are precomputed after each optimizer step, as its trainer does. The weights are drawn by its
``init_weights`` on the GPU under its seeding (``set_determinism``) (with ``--init normal``, drawn again as
transformers' Llama draws this repo's side: N(0, 0.02), the norms 1); the optimizer (fused AdamW), the LR
schedule and the loss come from its own builders.

Each step is what torchtitan's ``Trainer.train_step`` does with one micro-batch and no pipeline: zero the
gradients, count the step's target tokens on every rank (an all-reduce read on the host, as torchtitan does),
move the batch to the GPU, forward, summed cross-entropy over that count, backward, ``clip_grad_norm_`` at 1.0,
optimizer step, LR scheduler step, with its garbage-collection schedule. Its data loader and tokenizer are not
used: the batches are the very windows of the synthetic language that this repo's side trains on
(``recipe.data.source=synthetic``: recipes.gpt.synthetic_splits, same seed, sizes and vocabulary), held on the
host like torchtitan's batches.

The first ``--warmup-steps`` steps are not timed; the next ``--steps`` are, with the trainer's timer
(scripts/lib/timing.py: graphing.StepTimer's CUDA events, the interval between step ends, and the wall window from
the first timed step's start to the last one's end), the loss read on the host every ``--log-every`` steps as
torchtitan's trainer reads it at its log step and this repo's at train.log_every: the read stays out of the step
times and in the wall window, on both sides alike. With
``--profile-steps N``, N more steps run under torch.profiler (on the warm-up's batches again) and the JSON gets
their GPU work per step, read as scripts/profile_step.py reads this repo's (scripts/lib/kernel_profile.py).
Rank 0 writes one JSON to ``--output``: step ms median, p90 and mean, the wall window, the run's peak allocated and
reserved memory on its GPU, every step's loss (the global mean over ranks), the parameter count and torchtitan's FLOPs
per token.
Past ``--deadline-s`` a rank prints so and exits 124, so a hung run frees its GPU without a signal from outside.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from scripts.lib.llama3 import (
    BETAS, EPS, INIT_STD, LR, LR_WARMUP_STEPS, MAX_NORM, SHAPES, WEIGHT_DECAY, LlamaShape, parameter_count,
    training_flops_per_token,
)


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchtitan_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SHAPES), required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--local-batch", type=int, required=True)
    parser.add_argument("--warmup-steps", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ac", choices=("none", "full"), required=True)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--float8", action="store_true",
                        help="torchtitan's float8 converter: tensorwise, FSDP2 float8 all-gather, the scales "
                             "precomputed after each optimizer step, the output layer left out")
    parser.add_argument("--reshard", choices=("default", "never"), default="default",
                        help="parallelism.fsdp_reshard_after_forward: default (blocks resharded after forward) or never")
    parser.add_argument("--init", choices=("torchtitan", "normal"), default="torchtitan",
                        help="torchtitan: its init_weights (depth-scaled, the token embedding std 1); normal: every "
                             "Linear and embedding weight from N(0, 0.02), the norms 1, as transformers' Llama draws "
                             "this repo's side (bench_torchtitan.py --matched-init)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timed steps, profile this many more (the warm-up's batches again)")
    parser.add_argument("--log-every", type=int, default=0,
                        help="read the loss on the host every this many steps (this repo's train.log_every; 0: never "
                             "until the end)")
    parser.add_argument("--deadline-s", type=float, default=None)
    parser.add_argument("--output", type=Path, required=True)
    return parser.parse_args(argv)


def job_config(args: argparse.Namespace, dump_folder: str, cuda: bool):
    """torchtitan's JobConfig for this run: its defaults, with the Llama 3 8B preset's training settings and the
    run's shape, compile and activation checkpointing."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.job.dump_folder = dump_folder
    job.model.name = "llama3"
    job.model.flavor = SHAPES[args.size].flavour or args.size
    t = job.training
    # Every step the run takes, the profiled ones too: past training.steps its schedule's decay phase (of no
    # steps here) fails an assert.
    t.seq_len, t.local_batch_size = args.seq_len, args.local_batch
    t.steps = args.warmup_steps + args.steps + args.profile_steps
    t.max_norm = MAX_NORM
    t.dtype, t.mixed_precision_param, t.mixed_precision_reduce = "float32", "bfloat16", "float32"
    o = job.optimizer
    o.name, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay = "AdamW", LR, BETAS[0], BETAS[1], EPS, WEIGHT_DECAY
    o.implementation = "fused" if cuda else "foreach"  # fused: CUDA only, says torchtitan
    job.lr_scheduler.warmup_steps = LR_WARMUP_STEPS
    job.lr_scheduler.decay_ratio = 0.0  # no decay: warm-up, then constant, as trainer.step.schedules.Constant
    job.activation_checkpoint.mode = args.ac
    job.compile.enable = args.compile
    job.compile.components = ["model", "loss"]
    job.parallelism.data_parallel_shard_degree = -1  # FSDP over every rank
    job.parallelism.fsdp_reshard_after_forward = args.reshard
    job.debug.seed = args.seed
    if args.float8:  # its docs/float8.md settings; its 8B toml's float8 block, uncommented
        job.model.converters = ["quantize.linear.float8"]
        f8 = job.quantize.linear.float8
        f8.enable_fsdp_float8_all_gather = True
        f8.precompute_float8_dynamic_scale_for_fsdp = True
        f8.filter_fqns = ["output"]
    return job


def model_args_of(shape: LlamaShape):
    """torchtitan's TransformerModelArgs of ``shape``: its own flavour where 0.2.2 has one, else the 8B flavour's
    args at this shape's width, depth, heads and feed-forward multiplier (RoPE, norms, vocabulary as 8B)."""
    from torchtitan.models.llama3 import llama3_args

    if shape.flavour is not None:
        args = copy.deepcopy(llama3_args[shape.flavour])
    else:
        args = dataclasses.replace(copy.deepcopy(llama3_args["8B"]), dim=shape.dim, n_layers=shape.layers,
                                   n_heads=shape.heads, n_kv_heads=shape.kv_heads,
                                   ffn_dim_multiplier=shape.ffn_dim_multiplier, multiple_of=shape.multiple_of,
                                   vocab_size=shape.vocab)
    theirs = (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size, float(args.rope_theta),
              args.norm_eps, args.ffn_dim_multiplier, args.multiple_of)
    ours = (shape.dim, shape.layers, shape.heads, shape.kv_heads, shape.vocab, shape.rope_theta, shape.norm_eps,
            shape.ffn_dim_multiplier, shape.multiple_of)
    if theirs != ours:
        raise SystemExit(f"torchtitan_worker: torchtitan's {shape.flavour or '8B'} args {theirs} are not "
                         f"scripts/lib/llama3.py's {shape.name} shape {ours}: is torchtitan 0.2.2 installed?")
    return args


def batches(args: argparse.Namespace, rank: int, world: int, vocab: int) -> List[tuple]:
    """This rank's (inputs, labels) of every step, on the host: the training windows this repo's side draws
    (``recipe.data.train_size`` and ``test_size`` as scripts/bench_torchtitan.py sets them: the same tokens), each
    used once, rank r taking the r-th share of each step's windows (this repo's loader takes them in its own order)."""
    from recipes.gpt import synthetic_splits

    total = args.warmup_steps + args.steps
    train, _ = synthetic_splits(args.seed, args.seq_len, world * args.local_batch * total, world, vocab)
    out = []
    for step in range(total):
        first = (step * world + rank) * args.local_batch
        out.append((train.x[first:first + args.local_batch].long(), train.y[first:first + args.local_batch]))
    return out


class Steps:
    """torchtitan's training step over the prepared batches: what scripts/lib/timing.py times (``next_step``, the
    method it steps a Trainer by)."""

    def __init__(self, model, optimizers, lr_schedulers, loss_fn, amp, train_context, parallel_dims, gc_handler,
                 data: List[tuple], device):
        self.model, self.optimizers, self.lr_schedulers, self.loss_fn = model, optimizers, lr_schedulers, loss_fn
        self.amp, self.train_context, self.parallel_dims, self.gc = amp, train_context, parallel_dims, gc_handler
        self.data, self.device = data, device
        self.losses: List[Any] = []  # device tensors: read once, after the last step
        # The host's clock at each step's end: its step reads the global token count on the host (a sync), so
        # this is within a step of the GPU's end of it (time to loss in bench_torchtitan.py).
        self.ended_at: List[float] = []
        self.logged: List[tuple] = []  # (step, the mean loss since the read before): what read_metrics read
        self._read = 0  # steps whose losses were read

    def next_step(self) -> None:
        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.distributed import utils as dist_utils

        step = len(self.losses) + 1
        self.gc.run(step)
        inputs, labels = self.data[(step - 1) % len(self.data)]  # profiled steps, past the timed ones, reuse them
        self.optimizers.zero_grad()
        local_tokens = (labels != IGNORE_INDEX).sum().to(self.device)
        if self.parallel_dims.dp_enabled:
            global_tokens = dist_utils.dist_sum(local_tokens, self.parallel_dims.get_mesh("batch"))
        else:
            global_tokens = local_tokens.float()
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        with self.train_context():
            with self.amp:
                pred = self.model(inputs)
                loss = self.loss_fn(pred, labels) / global_tokens
            del pred
            loss.backward()
        dist_utils.clip_grad_norm_([p for p in self.model.parameters()], MAX_NORM, foreach=True,
                                   pp_mesh=None, ep_enabled=False)
        self.optimizers.step()
        self.lr_schedulers.step()
        self.losses.append(loss.detach())
        self.ended_at.append(time.time())

    def read_metrics(self) -> None:
        """What torchtitan's trainer does at its log step (``metrics.log_freq``): the loss of the steps since the last
        read, averaged over the ranks and read on the host (a sync); bench_torchtitan.py asks it at this repo's
        train.log_every, so that both sides read as often."""
        import torch
        import torch.distributed as dist

        window = torch.stack(self.losses[self._read:]).float().mean()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(window)  # each rank's loss is its share of the global mean: the sum is the mean
        self.logged.append((len(self.losses), window.item()))
        self._read = len(self.losses)


def redraw_as_transformers_does(model) -> None:
    """Every weight drawn as transformers' Llama draws this repo's side (``--init normal``): N(0, INIT_STD) for the
    Linear and embedding weights (token embedding and output too), 1 for the RMSNorm weights; the rotary
    frequencies (a buffer) stay init_weights'. trunc_normal_ with its default bounds (+-2, 100 standard deviations
    out) is that normal, and is the op torchtitan's own init_weights applies to these (sharded, possibly float8)
    weights."""
    import torch

    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            torch.nn.init.trunc_normal_(param, mean=0.0, std=INIT_STD)


def watchdog(deadline_s: Optional[float]) -> Optional[threading.Timer]:
    """Ends this process (exit 124) ``deadline_s`` seconds from now, naming why, unless cancelled first."""
    if not deadline_s:
        return None

    def expire() -> None:
        print(f"torchtitan_worker: rank {os.environ.get('RANK', '0')} ran past {deadline_s:.0f} s: stopping",
              file=sys.stderr, flush=True)
        os._exit(124)

    timer = threading.Timer(deadline_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    timer = watchdog(args.deadline_s)
    import torch
    import torch.distributed as dist
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.models.llama3 import Transformer, parallelize_llama
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.tools import utils as tt_utils

    from scripts.lib.kernel_profile import profile_steps
    from scripts.lib.timing import time_steps

    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    shape = SHAPES[args.size]
    job = job_config(args, str(args.output.parent / f"{args.output.stem}_dump"), cuda)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
    dist_utils.set_determinism(parallel_dims, device, job.debug, distinct_seed_mesh_dims=["pp"])

    model_args = model_args_of(shape)
    model_args.update_from_config(job)
    with torch.device("meta"), tt_utils.set_default_dtype(torch.float32):
        model = Transformer(model_args)
    n_params, flops = model_args.get_nparams_and_flops(model, args.seq_len)
    ffn = model.layers["0"].feed_forward.w1.weight.shape[0]
    if (n_params, ffn) != (parameter_count(shape), shape.ffn_hidden) \
            or flops != training_flops_per_token(shape, args.seq_len):
        raise SystemExit(f"torchtitan_worker: torchtitan's model has {n_params:,} parameters, feed-forward {ffn}, "
                         f"{flops:,} FLOPs per token; scripts/lib/llama3.py says {parameter_count(shape):,}, "
                         f"{shape.ffn_hidden}, {training_flops_per_token(shape, args.seq_len):,.0f}")
    converters = build_model_converters(job, parallel_dims)  # float8's Linear swap (--float8), before sharding
    converters.convert(model)
    loss_fn = build_cross_entropy_loss(job)
    model = parallelize_llama(model, parallel_dims, job)
    model.to_empty(device=device.type)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        if args.init == "normal":
            redraw_as_transformers_does(model)
    model.train()
    optimizers = build_optimizers([model], job.optimizer, parallel_dims)
    lr_schedulers = build_lr_schedulers(optimizers, job.lr_scheduler, job.training.steps)
    # As its trainer does: float8's scales for the next all-gather, after each optimizer step (no-op without it).
    optimizers.register_step_post_hook(lambda *args, **kwargs: converters.post_optimizer_hook([model]))
    amp = dist_utils.maybe_enable_amp(parallel_dims, job.training.mixed_precision_param, device.type)
    steps = Steps(model, optimizers, lr_schedulers, loss_fn, amp, dist_utils.get_train_context(False), parallel_dims,
                  tt_utils.GarbageCollection(gc_freq=job.training.gc_freq),
                  batches(args, rank, world, shape.vocab), device)

    # This repo's timer and wall window, metrics read at train.log_every's cadence (bench_torchtitan.py sets both)
    timed = time_steps(steps, args.steps, warmup=args.warmup_steps, log_every=args.log_every,
                       read_metrics=steps.read_metrics)
    profiled = profile_steps(steps.next_step, args.profile_steps, device.index) if args.profile_steps and cuda else None

    losses = torch.stack(steps.losses[:args.warmup_steps + args.steps]).float()
    if world > 1:
        dist.all_reduce(losses)  # each rank's loss is its token sum over the global count: the sum is the mean
    result: Dict[str, Any] = {
        "side": "torchtitan", "variant": "compiled" if args.compile else "eager", "size": args.size,
        "float8": args.float8,
        "torchtitan": _version("torchtitan"), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "world_size": world,
        "seq_len": args.seq_len, "local_batch": args.local_batch, "ac": args.ac, "compile": args.compile,
        "reshard": args.reshard, "init": args.init,
        "warmup_steps": args.warmup_steps, "parameters": n_params, "flops_per_token": flops,
        "data": f"the synthetic language of recipes.gpt (seed {args.seed}), not job_config.training.dataset",
        **timed, "log_every": args.log_every, "logged_losses": steps.logged,
        "losses": losses.tolist(), "step_ended_at": steps.ended_at[:args.warmup_steps + args.steps],
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20 if cuda else None,
        "profile": profiled,
        "settings": {"job_config": {k: dataclasses.asdict(getattr(job, k)) for k in (
            "training", "optimizer", "lr_scheduler", "activation_checkpoint", "compile", "parallelism")},
            "model_args": {k: v for k, v in dataclasses.asdict(model_args).items() if not k.startswith("_")}},
    }
    if rank == 0:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"torchtitan_worker: {result['variant']}: {result['step_ms_median']:.1f} ms/step (median), "
              f"{result['wall_steps']} steps in {result['wall_s']:.2f} s (wall window), "
              f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if timer is not None:
        timer.cancel()
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
