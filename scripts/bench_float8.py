"""float8 against bf16, side by side: the same train.py run with train.float8=none and with each float8 recipe,
for each graph mode, alternating in one call (none, tensorwise, ..., then the next mode).

    python scripts/bench_float8.py --nproc 1 -- recipe=gpt2_small recipe.data.batch_size=16
    python scripts/bench_float8.py --nproc 2 --all-gather -- recipe=gpt_1b recipe.data.batch_size=8
    python scripts/bench_float8.py --modes full_compiled --float8 tensorwise,rowwise --steps 300 -- recipe=gpt_1b

Per run: tokens/s per GPU over the wall window of its timed steps (results.json's perf/wall_*: the first timed
step's start to the last one's end, every metric read between counted; every run logs every 10 steps), the
median step, peak reserved memory, and the mean training loss over the last 10 logged values. Per float8 run:
its tokens/s and loss over bf16's in the same mode. ``--all-gather`` adds train.fsdp.float8_all_gather=true to
the tensorwise runs (FSDP2 only). Synthetic data, evaluation off. Prints a Markdown table; writes it and every
run's results to --output (default scripts/results/float8_<recipe>_<nproc>gpu.json and .md), every row with the
commit, versions and GPU it was measured with. A run that fails or runs past ``--timeout`` is marked in its row;
the others still run and are written, and the script exits 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from conf.schema import Float8  # noqa: E402
from scripts.lib.comparison import (  # noqa: E402
    exit_status, format_cell, provenance, provenance_line, with_provenance,
)
from scripts.lib.launch import gpu_name, parse_list, run_or_mark, train_launcher  # noqa: E402
from trainer.metrics import results  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402

DEFAULTS = ["logger=none", "train.progress=false", "train.eval=false", "recipe.data.source=synthetic",
            "train.log_every=10", "train.precision=bf16", "checkpoint.save=false"]
MODES = ("eager", "full", "full_compiled")
RECIPES = tuple(r.value for r in Float8 if r is not Float8.none)  # train.float8's own choices


def last_losses(run_dir: Path, count: int = 10) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    return statistics.mean(losses[-count:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun when > 1)")
    parser.add_argument("--modes", type=lambda s: parse_list(s, MODES, "mode"), default=list(MODES))
    parser.add_argument("--float8", type=lambda s: parse_list(s, RECIPES, "float8 recipe"), default=["tensorwise"])
    parser.add_argument("--all-gather", action="store_true", help="tensorwise with FSDP2's float8 all-gather")
    parser.add_argument("--emulate", action="store_true", help="torchao's emulation (a CPU smoke test; no speed)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--output", type=Path, default=None)
    args, cfg = script_config(parser, argv, defaults=DEFAULTS)
    variants = {"bf16": ["train.float8=none"]}
    for recipe in args.float8:
        gather = args.all_gather and recipe == "tensorwise"
        variants[recipe + (" + all-gather" if gather else "")] = [
            f"train.float8={recipe}", *(["train.fsdp.float8_all_gather=true"] if gather else []),
            *(["train.float8_emulate=true"] if args.emulate else [])]
    measured = provenance(gpu_name())
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for mode in args.modes:
            for name, extra in variants.items():
                run_dir = Path(scratch) / str(len(runs))
                command = [*train_launcher(args.nproc), *args.train_options, *DEFAULTS, *args.overrides,
                           f"graph={mode}", f"train.max_steps={args.steps}", *extra, f"run_dir={run_dir}"]
                wall, status = run_or_mark("bench_float8", f"{mode}, {name}", command, args.timeout)
                ok = status == "ok"
                runs.append({"mode": mode, "float8": name, "status": status, "wall_s": wall,
                             "loss_last10": last_losses(run_dir) if ok else None,
                             "results": json.loads((run_dir / "results.json").read_text()) if ok else {}})
    rows = with_provenance(table_rows(runs), measured)
    table = markdown(rows) + "\n\n" + provenance_line(measured)
    print(table)
    output = args.output or REPO / "scripts" / "results" / f"float8_{cfg.recipe.name}_{args.nproc}gpu.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"overrides": args.overrides, "steps": args.steps, "nproc": args.nproc,
                                  "provenance": measured, "rows": rows, "runs": runs}, indent=2) + "\n")
    output.with_suffix(".md").write_text(table + "\n")
    return exit_status("bench_float8.py", [(f"{run['mode']}, {run['float8']}", run["status"]) for run in runs])


def table_rows(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per run: tokens/s per GPU (wall window), the step, memory and loss, and its tokens/s and loss over
    bf16's in the same mode (None where either run failed)."""
    rows = []
    for run in runs:
        base = next((r for r in runs if r["mode"] == run["mode"] and r["float8"] == "bf16"), {})
        res, bres = run["results"], base.get("results") or {}
        tokens, btokens = res.get("perf/wall_tokens_per_s_per_gpu"), bres.get("perf/wall_tokens_per_s_per_gpu")
        loss, bloss = run["loss_last10"], base.get("loss_last10")
        reserved = res.get("perf/peak_reserved_mib")
        rows.append({"mode": run["mode"], "float8": run["float8"], "tokens_per_s_per_gpu": tokens,
                     "over_bf16": tokens / btokens if tokens and btokens else None,
                     "step_ms_median": res.get("perf/step_ms_median"),
                     "peak_reserved_gib": reserved / 1024 if reserved is not None else None,
                     "loss_last10": loss, "loss_over_bf16": loss / bloss if loss and bloss else None,
                     "status": run["status"]})
    return rows


COLUMNS = [("mode", "graph", "{}"), ("float8", "matmuls", "{}"),
           ("tokens_per_s_per_gpu", "tokens/s per GPU (wall window)", "{:,.0f}"), ("over_bf16", "over bf16", "{:.3f}x"),
           ("step_ms_median", "step ms (median)", "{:.1f}"), ("peak_reserved_gib", "peak reserved GiB", "{:.1f}"),
           ("loss_last10", "loss (last 10)", "{:.4f}"), ("loss_over_bf16", "loss over bf16", "{:.4f}"),
           ("status", "status", "{}")]


def markdown(rows: List[Dict[str, Any]]) -> str:
    return results.markdown_table([header for _, header, _ in COLUMNS],
                                  [[format_cell(row[key], form) for key, _, form in COLUMNS] for row in rows])


if __name__ == "__main__":
    sys.exit(main())
