"""What several input shapes cost a graphed run: memory of one graph per sequence-length
bucket against the largest alone, capture time per graph, and each bucket's throughput
graphed and eager.

    python scripts/bench_shapes.py                                 # gpt2_small, buckets 256,512,1024
    python scripts/bench_shapes.py --buckets 32,64,128 recipe=gpt_tiny recipe.model.context=128
    python scripts/bench_shapes.py --config-dir my_conf recipe=mine # your own configs, as train.py

Three runs of train.py on synthetic data, evaluation off, each --steps-per-bucket steps per
bucket: graph=full over the buckets, graph=eager over the same buckets, and graph=full over
the longest alone. The pool of the first against the last is the price of the extra graphs
(target: at most 1.25x). Prints a markdown table; writes it and the numbers to --output
(default scripts/results/shapes_<recipe>.json and .md).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.lib.launch import run_or_exit  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402

DEFAULTS = ["recipe=gpt2_small", "logger=none", "train.progress=false", "train.eval=false",
            "recipe.data.source=synthetic", "train.log_every=10"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", default="256,512,1024", help="sequence lengths, the longest the context")
    parser.add_argument("--steps-per-bucket", type=int, default=30, help="optimizer steps at each length")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--output", type=Path, default=None)
    args, cfg = script_config(parser, defaults=DEFAULTS)
    buckets = [int(b) for b in args.buckets.split(",")]
    steps = args.steps_per_bucket * len(buckets)
    bucketed = [f"recipe.data.seq_len_buckets=[{','.join(map(str, buckets))}]", f"train.max_steps={steps}"]
    runs = {"full, buckets": ["graph=full", *bucketed], "eager, buckets": ["graph=eager", *bucketed],
            "full, longest alone": ["graph=full", f"train.max_steps={args.steps_per_bucket + 12}"]}
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, extra in runs.items():
            command = [sys.executable, "train.py", *args.train_options, *DEFAULTS, *args.overrides, *extra,
                       f"run_dir={scratch}/{len(results)}"]
            run_or_exit("bench_shapes", name, command, args.timeout)
            results[name] = json.loads(Path(scratch, str(len(results)), "results.json").read_text())
    full, eager, alone = results["full, buckets"], results["eager, buckets"], results["full, longest alone"]
    unit = "tokens"
    rows = []
    for length in buckets:
        key = f"perf/bucket_T{length}/{unit}_per_s" if length != max(buckets) else f"perf/{unit}_per_s"
        graph_name = f"train@full@T{length}" if length != max(buckets) else "train@full"
        rows.append([f"T{length}", eager.get(key), full.get(key), full.get(key, 0) / eager.get(key, 1),
                     full.get(f"graph/{graph_name}/capture_s"), full.get(f"graph/{graph_name}/pool_mib")])
    ratio = full["graph/graph_pool_mib"] / alone["graph/graph_pool_mib"]
    table = "\n".join([
        f"| bucket | eager {unit}/s | graphed {unit}/s | graphed/eager | capture s | pool MiB after its capture |",
        "|---|---|---|---|---|---|",
        *(f"| {r[0]} | {r[1]:,.0f} | {r[2]:,.0f} | {r[3]:.2f}x | {r[4]:.2f} | {r[5]:,.0f} |" for r in rows),
        "",
        f"pool of all {len(buckets)} buckets' graphs: {full['graph/graph_pool_mib']:,.0f} MiB; of the longest alone: "
        f"{alone['graph/graph_pool_mib']:,.0f} MiB ({ratio:.2f}x). Peak allocated: graphed "
        f"{full['perf/peak_allocated_mib']:,.0f} MiB, eager {eager['perf/peak_allocated_mib']:,.0f} MiB, longest "
        f"alone graphed {alone['perf/peak_allocated_mib']:,.0f} MiB.",
    ])
    print(table)
    output = args.output or REPO / "scripts" / "results" / f"shapes_{cfg.recipe.name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"buckets": buckets, "pool_ratio": ratio, "runs": results}, indent=2) + "\n")
    output.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
