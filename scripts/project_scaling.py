"""Strong scaling, projected: at a fixed global batch, what do 8, 64 and 512 GPUs give, eager vs graphed?

    python scripts/sweep.py --recipes mnist --nprocs 1,2 --batch-sizes 8,16,32,64,128,256,512 --output /tmp/sw
    python scripts/project_scaling.py --sweep /tmp/sw/sweep.json --recipe mnist --global-batch 4096

More GPUs at a fixed global batch mean a smaller batch per GPU: the step gets shorter but
no cheaper to launch, so launch overhead (what a CUDA graph removes) grows as a share of
it, while the gradient all-reduce stays. The model, with every assumption a flag:

- compute: the 1-GPU step time of each mode at batch ``global / N`` per GPU, interpolated
  log-log between the measured batch sizes of the sweep; below the smallest one it stays
  at that one's time (a launch-bound step does not get faster with fewer samples); above
  the largest nothing is projected ("beyond the sweep"): a flat, launch-bound eager curve
  says nothing about the batch where it turns GPU-bound. Sweep larger batches to fill it.
- all-reduce of the fp32 gradients (4 bytes per parameter; DDP reduces fp32 gradients in
  bf16 runs too): inside a node of ``--gpus-per-node`` GPUs a ring over NVLink,
  ``2 (g-1)/g * bytes / nvlink_bw + 2 (g-1) * nvlink_latency``; across ``n`` nodes, on each
  GPU's shard ``s = bytes / g``, the faster of a ring, ``2 (n-1)/n * s / ib_bw + 2 (n-1) *
  ib_latency``, and a tree, ``2 s / ib_bw + 2 ceil(log2 n) * ib_latency``, as NCCL picks
  (a hierarchical all-reduce: reduce-scatter and all-gather inside the node).
- no overlap of the all-reduce with backward (DDP overlaps buckets with backward, so
  this is an upper bound on the exposed time), and the same all-reduce time in both modes;
  ``--allreduce-scale`` multiplies it by what was measured (scripts/bench_allreduce.py: the
  2-GPU step minus the 1-GPU step, over this model's 2-GPU all-reduce; by default 1.73, CIFAR
  ResNet-18 on two H200s, which also charges DDP's own per-parameter work to the wire; 1: the
  model alone), and
  ``--grad-bytes-per-param 2`` models ``train.ddp.grad_reduce=bf16``.
- step(N, mode) = compute + all-reduce; graph speedup = step(N, eager) / step(N, graph).

The check: for every 2-GPU point of the sweep, the model's step next to the measured one.
Prints markdown and writes ``projection.json`` / ``projection.md`` into ``--output``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.lib.allreduce_model import (  # noqa: E402
    MEASURED_ALLREDUCE_SCALE, Links, allreduce_s, parameter_count,
)
from scripts.lib.refuse import refuse  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402


def step_ms_at(curve: Dict[int, float], batch: float) -> Optional[float]:
    """The 1-GPU step time at ``batch`` from measured (batch -> ms) points (see the module docstring)."""
    sizes = sorted(curve)
    if batch <= sizes[0]:
        return curve[sizes[0]]
    if batch > sizes[-1]:
        return None  # beyond the sweep: a launch-bound curve says nothing about where it turns GPU-bound
    if batch == sizes[-1]:
        return curve[batch]
    hi = next(s for s in sizes if s >= batch)
    lo = sizes[sizes.index(hi) - 1]
    t = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp(math.log(curve[lo]) + t * (math.log(curve[hi]) - math.log(curve[lo])))


def sweep_points(data: Any, recipe: str) -> List[dict]:
    """The points of scripts/sweep.py's sweep.json (a list, or {"points": [...]}), or of
    scripts/results/sweeps_h200.json ({"sweeps": {recipe: {"points": [...]}}}: one GPU each)."""
    if isinstance(data, dict) and "sweeps" in data:
        one = data["sweeps"].get(recipe, {}).get("points", [])
        return [{"recipe": recipe, "nproc": 1, **p} for p in one]
    return data["points"] if isinstance(data, dict) else data


def curves(points: Sequence[dict], recipe: str, nproc: int) -> Dict[str, Dict[int, float]]:
    """mode -> {batch size per GPU: median step ms} of the sweep's ``nproc``-GPU points that ran."""
    out: Dict[str, Dict[int, float]] = {}
    for p in points:
        if p["recipe"] == recipe and p["nproc"] == nproc and p.get("step_ms_median") and p["status"].startswith("ok"):
            out.setdefault(p["mode"], {})[int(p["batch_size"])] = float(p["step_ms_median"])
    return out


def project(one_gpu: Dict[str, Dict[int, float]], global_batch: int, gpus: Sequence[int], grad_bytes: float,
            links: Links, graph_mode: str = "full", allreduce_scale: float = 1.0) -> List[dict]:
    rows = []
    for n in gpus:
        per_gpu = global_batch / n
        comm_ms = 1e3 * allreduce_s(grad_bytes, n, links) * allreduce_scale
        row = {"gpus": n, "batch_per_gpu": per_gpu, "allreduce_ms": comm_ms}
        for mode, curve in one_gpu.items():
            compute = step_ms_at(curve, per_gpu)
            row[f"{mode}_step_ms"] = None if compute is None else compute + comm_ms
        eager, graph = row.get("eager_step_ms"), row.get(f"{graph_mode}_step_ms")
        if eager is not None and graph is not None:
            row["graph_speedup"] = eager / graph
        rows.append(row)
    return rows


def check_two_gpus(points: Sequence[dict], recipe: str, one_gpu: Dict[str, Dict[int, float]], grad_bytes: float,
                   links: Links, allreduce_scale: float = 1.0) -> List[dict]:
    """The model against every measured 2-GPU point: predicted vs measured step."""
    rows = []
    for mode, curve in curves(points, recipe, 2).items():
        for batch, measured in sorted(curve.items()):
            if mode not in one_gpu or batch not in one_gpu[mode]:
                continue
            predicted = one_gpu[mode][batch] + 1e3 * allreduce_s(grad_bytes, 2, links) * allreduce_scale
            rows.append({"mode": mode, "batch_per_gpu": batch, "measured_ms": measured, "predicted_ms": predicted,
                         "error": predicted / measured - 1})
    return rows


def markdown(recipe: str, global_batch: int, grad_bytes: float, rows: List[dict], check: List[dict],
             links: Links, modes: Sequence[str], allreduce_scale: float = 1.0) -> str:
    from trainer.metrics.results import markdown_table

    table = markdown_table(
        ["GPUs", "batch/GPU", "all-reduce ms", *(f"{m} step ms" for m in modes), "graph speedup"],
        [[str(r["gpus"]), f"{r['batch_per_gpu']:g}", f"{r['allreduce_ms']:.3f}",
          *("beyond the sweep" if r[f"{m}_step_ms"] is None else f"{r[f'{m}_step_ms']:.3f}" for m in modes),
          "—" if r.get("graph_speedup") is None else f"{r['graph_speedup']:.2f}x"] for r in rows])
    lines = [f"### {recipe}: global batch {global_batch}, {grad_bytes / 2**20:.1f} MiB of gradients", "", table]
    if check:
        lines += ["", "Model vs measured, 2 GPUs:", "", markdown_table(
            ["mode", "batch/GPU", "measured ms", "model ms", "error"],
            [[c["mode"], c["batch_per_gpu"], f"{c['measured_ms']:.3f}", f"{c['predicted_ms']:.3f}",
              f"{100 * c['error']:+.0f}%"] for c in check])]
    lines += ["", "Assumptions: " + ", ".join(f"{k}={v}" for k, v in asdict(links).items())
              + f"; all-reduce x{allreduce_scale:g} (no overlap with backward at x1); compute from the 1-GPU sweep."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", type=Path, required=True, help="sweep.json from scripts/sweep.py")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--global-batch", type=int, required=True, help="samples (sequences) per optimizer step")
    parser.add_argument("--gpus", default="1,2,8,64,512")
    parser.add_argument("--graph-mode", default="full", help="the graph mode the speedup is for")
    parser.add_argument("--params", type=int, default=None, help="trainable parameters (default: build the recipe)")
    parser.add_argument("--allreduce-scale", type=float, default=MEASURED_ALLREDUCE_SCALE,
                        help="the modeled all-reduce times this (default: measured on 2x H200 by "
                             "scripts/bench_allreduce.py; 1: the model alone)")
    parser.add_argument("--grad-bytes-per-param", type=float, default=4.0, help="4: fp32 gradients; 2: grad_reduce=bf16")
    parser.add_argument("--output", type=Path, default=None)
    for name, value in asdict(Links()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    # Without --params the recipe is built (on tiny synthetic data) to count them: train.py's overrides and
    # --config-dir reach it; with --params nothing is composed.
    args, cfg = script_config(parser, argv, defaults=lambda a: None if a.params else [
        f"recipe={a.recipe}", "recipe.data.source=synthetic", "recipe.data.train_size=64", "recipe.data.test_size=16"])
    links = Links(**{k: getattr(args, k) for k in asdict(Links())})
    if not args.sweep.is_file():
        refuse(f"--sweep {args.sweep}: no such file; give the sweep.json that scripts/sweep.py wrote")
    points = sweep_points(json.loads(args.sweep.read_text()), args.recipe)
    one_gpu = curves(points, args.recipe, 1)
    if "eager" not in one_gpu or args.graph_mode not in one_gpu:
        refuse(f"{args.sweep} has no 1-GPU eager and {args.graph_mode} points for recipe {args.recipe}: "
               f"run scripts/sweep.py --recipes {args.recipe} --nprocs 1 (with modes eager,{args.graph_mode})")
    params = args.params or parameter_count(cfg)
    if args.allreduce_scale <= 0 or args.grad_bytes_per_param <= 0:
        refuse("--allreduce-scale and --grad-bytes-per-param must be positive")
    grad_bytes = args.grad_bytes_per_param * params
    gpus = [int(g) for g in args.gpus.split(",")]
    rows = project(one_gpu, args.global_batch, gpus, grad_bytes, links, args.graph_mode, args.allreduce_scale)
    check = check_two_gpus(points, args.recipe, one_gpu, grad_bytes, links, args.allreduce_scale)
    text = markdown(args.recipe, args.global_batch, grad_bytes, rows, check, links, list(one_gpu), args.allreduce_scale)
    print(text)
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "projection.md").write_text(text + "\n")
        (args.output / "projection.json").write_text(json.dumps(
            {"recipe": args.recipe, "global_batch": args.global_batch, "params": params, "links": asdict(links),
             "allreduce_scale": args.allreduce_scale, "grad_bytes": grad_bytes,
             "rows": rows, "two_gpu_check": check}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
