"""Two GPUs against one, and strong scaling over every GPU count the machine has: how much of the
graphed step is DDP's gradient all-reduce that backward does not hide, what `train.ddp` does
about it, and throughput at a fixed global batch on 1, 2, 4, ... GPUs (issue 24, part 2; issue 37).

    python scripts/bench_allreduce.py                        # both parts, on a machine with 2 or more GPUs
    python scripts/bench_allreduce.py --parts allreduce --batch-size 128
    python scripts/bench_allreduce.py --parts scaling --global-batches 64,256 --modes eager,full,full_compiled
    python scripts/bench_allreduce.py --parts scaling --gpus 1,2,4,8 --recipe gpt2_small --global-batches 32

``allreduce``: ``recipe`` (default cifar10_resnet18) with ``graph=full`` at ``--batch-size`` per
GPU, once on one GPU in one process (no DDP), then on two GPUs under torchrun once per
variant: the recipe's settings, ``train.ddp.bucket_cap_mb`` of each of ``--bucket-caps``,
``train.ddp.grad_reduce=bf16``, ``train.ddp.static_graph=true`` and
``train.ddp.broadcast_buffers`` true and false (and once on one GPU under torchrun: DDP with one rank,
its own work without communication). Each 2-GPU step over the
1-GPU step (target: at most 1.05x), and the exposed all-reduce (their difference) against
scripts/project_scaling.py's no-overlap model of it, as the ``--allreduce-scale`` that
script takes. ``scaling``: the same recipe at each global batch on each of ``--gpus`` (default:
1, 2, 4 and 8, as many as the machine has) in each mode: throughput, speedup over one GPU and
efficiency (throughput on N over N times that on 1).

Synthetic data, evaluation off, ``--steps`` optimizer steps per run; step ms is the median after
warm-up and capture. On machines with NVLink multicast, export NCCL_NVLS_ENABLE=0 first if
your cluster asks for it. Prints markdown; writes JSON and markdown to --output (default
scripts/results/allreduce_<recipe>.json and .md).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.lib.comparison import throughput_unit  # noqa: E402
from scripts.lib.launch import run_or_exit, train_launcher  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402

COMMON = ["recipe.data.source=synthetic", "logger=none", "train.progress=false", "train.eval=false",
          "checkpoint.keep=1", "train.log_every=20"]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="cifar10_resnet18")
    parser.add_argument("--parts", default="allreduce,scaling", help="allreduce, scaling, or both")
    parser.add_argument("--batch-size", type=int, default=128, help="allreduce: samples per GPU")
    parser.add_argument("--bucket-caps", default="5,2", help="allreduce: train.ddp.bucket_cap_mb values to try (MiB)")
    parser.add_argument("--global-batches", default="64,256", help="scaling: samples per optimizer step")
    parser.add_argument("--modes", default="eager,full,full_compiled", help="scaling: graph modes")
    parser.add_argument("--gpus", default=None,
                        help="scaling: GPU counts, e.g. 1,2,4 (default: 1, 2, 4 and 8, up to the machine's)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"allreduce", "scaling"}:
        parser.error(f"--parts {args.parts}: choose from allreduce, scaling")

    import torch  # after the command line: --help answers at once

    have = torch.cuda.device_count()
    if have < 2:
        refuse(f"bench_allreduce.py compares 2 or more GPUs with one: this machine has {have}")
    try:
        args.gpu_counts = gpu_counts(args.gpus, have)
    except ValueError as e:
        parser.error(str(e))
    out: Dict[str, Any] = {"recipe": args.recipe, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    text = []
    with tempfile.TemporaryDirectory() as scratch:
        runner = Runner(args, Path(scratch))
        if "allreduce" in parts:
            out["allreduce"] = allreduce_part(runner, args)
            text.append(allreduce_markdown(out["allreduce"], args))
        if "scaling" in parts:
            out["scaling"] = scaling_part(runner, args)
            text.append(scaling_markdown(out["scaling"]))
    print("\n\n".join(text))
    output = args.output or REPO / "scripts" / "results" / f"allreduce_{args.recipe}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(out, indent=2) + "\n")
    output.with_suffix(".md").write_text("\n\n".join(text) + "\n")
    return 0


class Runner:
    """Runs train.py on 1 GPU (one process, no DDP) or on N under torchrun; returns its results.json."""

    def __init__(self, args, scratch: Path):
        self.args, self.scratch, self.count = args, scratch, 0

    def __call__(self, name: str, gpus: int, batch: int, *extra: str, torchrun: bool = False) -> Dict[str, Any]:
        self.count += 1
        run_dir = self.scratch / str(self.count)
        command = [*train_launcher(gpus, torchrun), f"recipe={self.args.recipe}", *COMMON,
                   f"recipe.data.batch_size={batch}", f"train.max_steps={self.args.steps}", *extra, f"run_dir={run_dir}"]
        run_or_exit("bench_allreduce", name, command, self.args.timeout)
        result = json.loads((run_dir / "results.json").read_text())
        unit = throughput_unit(result).removesuffix("/s")
        row = {"name": name, "gpus": gpus, "batch_per_gpu": batch, "overrides": list(extra),
               "step_ms": result["perf/step_ms_median"], "throughput": result[f"perf/{unit}_per_s"],
               "unit": unit, "final_loss": result.get("final/loss")}
        # Each run's numbers as they come, so a machine taken away mid-benchmark still leaves them.
        print(f"bench_allreduce: {name}: {row['step_ms']:.3f} ms/step, {row['throughput']:,.0f} {unit}/s, "
              f"loss {row['final_loss']}", flush=True)
        return row


def allreduce_part(run: Runner, args) -> Dict[str, Any]:
    from scripts.lib.allreduce_model import Links, allreduce_s, parameter_count_of

    batch = args.batch_size
    one = run("1 GPU", 1, batch, "graph=full")
    # One rank under torchrun: DDP's own work in the step with nothing to exchange.
    one_ddp = run("1 GPU, DDP with 1 rank", 1, batch, "graph=full", torchrun=True)
    variants = {"2 GPUs, the recipe's settings": [],
                **{f"2 GPUs, bucket_cap_mb={c}": [f"train.ddp.bucket_cap_mb={c}"] for c in args.bucket_caps.split(",")},
                "2 GPUs, grad_reduce=bf16": ["train.ddp.grad_reduce=bf16"],
                "2 GPUs, static_graph": ["train.ddp.static_graph=true"],
                **{f"2 GPUs, broadcast_buffers={b}": [f"train.ddp.broadcast_buffers={b}"] for b in ("true", "false")}}
    modeled_ms = 1e3 * allreduce_s(4.0 * parameter_count_of(args.recipe), 2, Links())
    rows = []
    for name, extra in variants.items():
        two = run(name, 2, batch, "graph=full", *extra)
        exposed = two["step_ms"] - one["step_ms"]
        rows.append({**two, "over_one_gpu": two["step_ms"] / one["step_ms"], "exposed_allreduce_ms": exposed,
                     "allreduce_scale": exposed / modeled_ms})
    return {"one_gpu": one, "one_rank_ddp": one_ddp, "two_gpus": rows, "modeled_allreduce_ms": modeled_ms}


def allreduce_markdown(part: Dict[str, Any], args) -> str:
    one = part["one_gpu"]
    one_ddp = part["one_rank_ddp"]
    lines = [f"### graph=full at {args.batch_size} per GPU: 1 GPU {one['step_ms']:.3f} ms; the same under torchrun "
             f"(DDP, 1 rank, nothing sent) {one_ddp['step_ms']:.3f} ms ({one_ddp['step_ms'] / one['step_ms']:.3f}x)", "",
             "| run | step ms | over 1 GPU | exposed all-reduce ms | over the model's | final loss |",
             "|---|---|---|---|---|---|"]
    for r in part["two_gpus"]:
        lines.append(f"| {r['name']} | {r['step_ms']:.3f} | {r['over_one_gpu']:.3f}x | {r['exposed_allreduce_ms']:.3f} | "
                     f"{r['allreduce_scale']:.2f} | {r['final_loss']:.4f} |")
    lines += ["", f"No-overlap model of one fp32 all-reduce on 2 GPUs (scripts/project_scaling.py): "
                  f"{part['modeled_allreduce_ms']:.3f} ms; pass the measured ratio to it as --allreduce-scale."]
    return "\n".join(lines)


def gpu_counts(asked: Optional[str], have: int) -> List[int]:
    """The GPU counts the scaling part compares: ``asked`` ("1,2,4"), or 1, 2, 4, 8 up to ``have``; 1 always first."""
    if asked is None:
        return [n for n in (1, 2, 4, 8) if n <= have]
    counts = sorted({int(n) for n in asked.split(",")} | {1})
    if counts[0] < 1 or counts[-1] > have:
        raise ValueError(f"--gpus {asked}: this machine has {have} GPUs; choose counts from 1 to {have}")
    if len(counts) < 2:
        raise ValueError(f"--gpus {asked}: name a count above 1 to compare with one GPU")
    return counts


def scaling_part(run: Runner, args) -> List[Dict[str, Any]]:
    rows = []
    for global_batch in (int(b) for b in args.global_batches.split(",")):
        for mode in args.modes.split(","):
            runs = []
            for gpus in args.gpu_counts:
                if global_batch % gpus:
                    refuse(f"bench_allreduce.py: --global-batches {global_batch} does not split over {gpus} GPUs: "
                           "choose global batches that every --gpus count divides")
                runs.append(run(f"{mode}, global {global_batch}, {gpus} GPU{'s' * (gpus > 1)}", gpus,
                                global_batch // gpus, f"graph={mode}"))
            one = runs[0]["throughput"]
            for r in runs:
                r["speedup"], r["efficiency"] = r["throughput"] / one, r["throughput"] / (r["gpus"] * one)
            rows.append({"global_batch": global_batch, "mode": mode, "runs": runs})
    return rows


def scaling_markdown(rows: List[Dict[str, Any]]) -> str:
    if not rows:
        return ""
    unit = rows[0]["runs"][0]["unit"]
    counts = [r["gpus"] for r in rows[0]["runs"]]
    head = [f"{n} GPU{'s' * (n > 1)} {unit}/s" + (" (speedup, efficiency)" if n > 1 else "") for n in counts]
    lines = [f"### Strong scaling: {', '.join(map(str, counts))} GPUs at a fixed global batch", "",
             f"| global batch | mode | {' | '.join(head)} |", "|---|---|" + "---|" * len(counts)]
    for r in rows:
        cells = [f"{x['throughput']:,.0f}" + (f" ({x['speedup']:.2f}x, {x['efficiency']:.2f})" if x["gpus"] > 1 else "")
                 for x in r["runs"]]
        lines.append(f"| {r['global_batch']} | {r['mode']} | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
