"""Where the time of one training step goes, on one GPU (or each of torchrun's).

    python scripts/profile_step.py graph=full                # any train.py overrides
    python scripts/profile_step.py graph=eager --steps 100
    python scripts/profile_step.py --config-dir my_conf recipe=mine   # your own configs, as train.py

Builds the trainer as train.py does, warms up (and captures, in graph modes), then
profiles ``--steps`` steps: the step's wall time (``--steps`` steps timed as train.py times them,
graphing.StepTimer, before the profiled ones), the time during which at least one kernel or copy
ran (CUPTI; ``kernel_ms`` sums them over streams), its ratio to the step (how busy the GPU
was), the kernel count per step, the kernels' time by kind (matmuls, attention, collectives, fused
Triton kernels, ...: scripts/lib/kernel_profile.py, which reads torchtitan's step the same way for
scripts/bench_torchtitan.py), throughput (global and per GPU) and MFU per GPU, as train.py's
results compute it. Under torchrun every rank profiles; rank 0 reports. ``--top N`` adds the N kernels that took the
most time per step, with their counts (where the time goes, and where each op comes from);
``--gaps N`` the N places where the GPU sat idle longest in a step, summed per step, each
named by the ops before and after it (where a graphed step still waits). ``--streams`` lists
each CUDA stream the step's kernels ran on (ms and ops per step, its busiest kernels) and how
much of the collectives' time (NCCL kernels: DDP's all-reduce, FSDP2's all-gathers and
reduce-scatters) ran beside other kernels: whether communication overlaps compute, inside the
graph as in eager. ``--memory`` records the allocator's history from the build to the end of the warm-up
(and capture) and says what each memory pool holds (scripts/lib/memory_pools.py): reserved, the most live at
once, the most freed but waiting on another stream, per stream, each stream named where the run knows it
(capture, metrics, FSDP2's); a graph's pool reserved far above its most live is memory the capture could not
reuse.
``--power`` samples the GPU's power draw and SM clock over the timed steps (scripts/lib/gpu_power.py): at the power
limit a step takes its energy over the limit, so ``power.joules_per_step`` compares two steps where their
kernel lists look alike. Prints a line and writes JSON to --output.

    python scripts/profile_step.py recipe=gpt_tiny train.parallel=fsdp2 graph=full --steps 20 --streams
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.lib.gpu_power import describe as describe_power, sampler  # noqa: E402
from scripts.lib.kernel_profile import device_events, summary  # noqa: E402
from scripts.lib.memory_pools import describe as describe_pools, pool_report  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402
from scripts.lib.timing import time_steps  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402
from trainer.session import Session  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output", type=Path, default=None, help="JSON file for the numbers")
    parser.add_argument("--top", type=int, default=0, help="list the N kernels with the most time per step")
    parser.add_argument("--gaps", type=int, default=0, help="list the N places the GPU sat idle longest per step")
    parser.add_argument("--streams", action="store_true",
                        help="list the CUDA streams the kernels ran on, and the collectives' overlap with compute")
    parser.add_argument("--power", action="store_true",
                        help="the GPU's energy, power and SM clock over the timed steps (NVML, read every 100 ms; "
                             "pip install nvidia-ml-py)")
    parser.add_argument("--memory", action="store_true",
                        help="record the allocator's history from the build to the first graph and say what each "
                             "memory pool holds: reserved, most live at once, most waiting to be freed, per stream")
    args, cfg = script_config(parser, defaults=["logger=none", "train.progress=false"])
    import torch  # after the command line: --help and a bad override answer at once

    if not torch.cuda.is_available():
        refuse("profile_step.py measures GPU kernels: run it on a machine with CUDA")
    return Session(cfg, purpose="profile").execute(lambda session: profile_job(session, args))


def profile_job(session, args) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if args.memory:  # from before the model exists: every block of the run's pools is in the history
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    trainer = session.build()
    ex, loader = trainer.executor, trainer.train_loader
    needed = args.steps * 2 + trainer.plan.graph.warmup_iters + 1
    if loader.shapes.full_steps < needed:
        refuse(f"need {needed} steps in one epoch, the data gives {loader.shapes.full_steps}: lower --steps")
    trainer.warm_up()
    pools = memory_pools(args.memory)
    for _ in range(args.steps):  # settle
        trainer.next_step()
    with sampler(args.power, torch.cuda.current_device()) as power:  # --power: the GPU's draw, clock
        start = time.monotonic()
        wall_ms = time_steps(trainer, args.steps)["step_ms_mean"]  # train.py's timer, outside the profiler's overhead
        end = time.monotonic()

    # The profiler's window is not timed: CUPTI gives its kernels' spans; the sync keeps them all inside it.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            trainer.next_step()
        torch.cuda.synchronize()
    events = device_events(prof, torch.cuda.current_device())
    found = summary(events, args.steps, top=args.top, gaps=args.gaps)
    mode = ex.report.mode + ("+compile_model" if trainer.plan.graph.compile_model else "")
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "mode": mode, "recipe": trainer.recipe.name,
        "world_size": trainer.rt.world_size, "batch_size": session.cfg.recipe.data.batch_size,
        "precision": trainer.plan.precision, "step_ms": wall_ms, "gpu_busy_ms": found["gpu_busy_ms"],
        "gpu_busy_fraction": found["gpu_busy_ms"] / wall_ms, "kernel_ms": found["kernel_ms"],
        "gpu_ops_per_step": found["gpu_ops_per_step"], "kinds": found["kinds"],
    }
    if args.power:
        result["power"] = power.window(start, end, wall_ms)
    units_per_s = trainer.global_batch * trainer.recipe.units_per_sample * 1e3 / wall_ms
    result[f"{trainer.recipe.unit}_per_s"] = units_per_s
    result[f"{trainer.recipe.unit}_per_s_per_gpu"] = units_per_s / trainer.rt.world_size
    mfu = trainer.perf.mfu_pct(units_per_s / trainer.rt.world_size)  # train.py's MFU: per GPU
    if mfu is not None:
        result["mfu_pct"] = mfu
    if pools is not None:
        result["memory_pools"], result["stream_names"] = pools, stream_names(trainer)
    if args.top:
        result["top_kernels"] = found["top_kernels"]
    if args.gaps:
        result["idle_ms"], result["idle_gaps"] = found["idle_ms"], found["idle_gaps"]
    if args.streams:
        result["streams"] = found["streams"]
        result["collective_ms"] = found["collective_ms"]
        result["collective_beside_compute_ms"] = found["collective_beside_compute_ms"]
    if not trainer.rt.is_main:  # one report: rank 0's (every rank ran the same steps)
        return 0
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("top_kernels", "idle_gaps", "streams", "kinds", "memory_pools", "power")}))
    if args.power:
        print(describe_power(result["power"]))
    for line in describe_pools(result.get("memory_pools", []), result.get("stream_names")):
        print(line)
    for row in result["kinds"]:
        print(f"  {row['ms_per_step']:8.4f} ms  {row['per_step']:7.1f} kernels  {row['kind']}")
    for row in result.get("streams", []):
        print(f"  stream {row['stream']}: {row['ms_per_step']:8.4f} ms {row['ops_per_step']:7.1f} ops per step; "
              f"{'; '.join(name[:50] for name in row['busiest'])}")
    for row in result.get("top_kernels", []):
        print(f"  {row['ms_per_step']:8.4f} ms  {row['per_step']:6.1f}x  {row['name'][:110]}")
    for row in result.get("idle_gaps", []):
        print(f"  idle {row['ms_per_step']:8.4f} ms  {row['per_step']:6.1f}x  after {row['after'][:60]}  "
              f"before {row['before'][:60]}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def memory_pools(recorded: bool):
    """What each memory pool holds after the warm-up and the capture (scripts/lib/memory_pools.py), from the
    history recorded since the build; the recording then stops (its cost stays out of the timed steps)."""
    if not recorded:
        return None
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return pool_report(snapshot, torch.cuda.current_device())


def stream_names(trainer) -> dict:
    """What each CUDA stream of the run is, keyed as the allocator's history keys them (the ``cudaStream_t`` as an
    int, in a string): the default stream, the executor's capture stream, the step's metrics stream, and FSDP2's
    collective streams (from each sharded module's state: torch's private attributes, read where they exist)."""
    named = {"0": "the default stream"}

    def name(stream, what: str) -> None:
        if stream is not None:
            named.setdefault(str(stream.cuda_stream), what)

    name(getattr(trainer.executor, "side", None), "capture (warm-up and graphs)")
    name(getattr(trainer.train_step, "metrics_stream", None), "the step's metrics")
    for module in trainer.raw_model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        comm = getattr(state, "_comm_ctx", None)
        for attr in ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream", "all_reduce_stream"):
            name(getattr(comm, attr, None), "FSDP2 " + attr[:-len("_stream")].replace("_", "-"))
    return named


if __name__ == "__main__":
    sys.exit(main())
