"""Sharded training (train.parallel=fsdp2) on this machine's GPUs, next to DDP, in one table.

    python scripts/check_fsdp2.py                                # every GPU: gpt2_small, 200 steps per run
    python scripts/check_fsdp2.py --nproc 2 --steps 100 -- recipe=gpt_tiny
    python scripts/check_fsdp2.py --nproc 2 -- recipe=gpt_tiny device=cpu   # no GPU: eager only, over gloo

Runs train.py four times, one after another, with the same overrides apart from
``train.parallel`` (ddp, fsdp2) and ``graph`` (eager, full): each on ``--nproc`` ranks (torchrun
when more than one), ``--steps`` steps, synthetic data, no evaluation and no checkpoint. Prints
a table and writes it (check_fsdp2.md) and every run's results (check_fsdp2.json) into
``--output``: per run its throughput per GPU, median step, peak allocated memory per GPU (what
sharding saves), final loss and its distance from eager's under the same ``train.parallel``
(the graphed step trains as the eager one: fp32 agrees to rounding, bf16 within a few of its
rounding steps). Exit 1 when a run failed. Resuming a sharded checkpoint on another number of
GPUs, and the collectives' overlap with compute, are docs/sharding.md's commands.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as `python scripts/check_fsdp2.py`: find conf/ and scripts/

from scripts.lib.comparison import comparison_rows  # noqa: E402
from scripts.lib.launch import (  # noqa: E402
    RESERVED, check_overrides, cuda_device_count, exit_on_sigterm, failed, launch_mode, timestamp,
)
from trainer.run.cli import script_config  # noqa: E402
from trainer.metrics.results import markdown_table  # noqa: E402

DEFAULTS = ["recipe=gpt2_small", "recipe.data.source=synthetic", "logger=none", "train.progress=false",
            "train.eval=false", "checkpoint.save=false", "train.epochs=1000"]  # --steps alone ends a run
PARALLELS, MODES = ("ddp", "fsdp2"), ("eager", "full")
SETS = (*RESERVED, "train.parallel", "train.max_steps")  # the script's, per run


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None, help="ranks per run (default: the CUDA GPU count, or 1)")
    parser.add_argument("--steps", type=int, default=200, help="train.max_steps of every run")
    parser.add_argument("--output", type=Path, default=None, help="directory (default: outputs/check_fsdp2/<timestamp>)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is stopped")
    args, _ = script_config(parser, argv, defaults=DEFAULTS)  # a typo fails here once, not once per run
    check_overrides(args.overrides, SETS, "check_fsdp2.py")
    gpus = cuda_device_count()
    nproc = max(gpus, 1) if args.nproc is None else args.nproc
    if nproc < 1 or args.steps < 1:
        parser.error("--nproc and --steps must be at least 1")
    exit_on_sigterm()
    output = (args.output or ROOT / "outputs" / "check_fsdp2" / timestamp()).resolve()
    output.mkdir(parents=True, exist_ok=True)
    print(f"ddp and fsdp2, eager and full, {nproc} rank{'s' * (nproc > 1)} on {'CUDA' if gpus else 'CPU'} "
          f"into {output}", flush=True)

    rows: List[Dict[str, Any]] = []
    for parallel in PARALLELS:
        train_args = [*args.train_options, *DEFAULTS, *args.overrides, f"train.parallel={parallel}",
                      f"train.max_steps={args.steps}"]
        outcomes = []
        for mode in MODES:
            print(f"{parallel} {mode}: ", end="", flush=True)
            outcomes.append(launch_mode(mode, nproc, train_args, output / parallel, group=output.name,
                                        run_name=f"{output.name}-{parallel}", timeout=args.timeout, cuda=gpus > 0))
            print(outcomes[-1]["status"], flush=True)
        rows += [{"parallel": parallel, **row} for row in with_loss_vs_eager(comparison_rows(outcomes))]
    table = markdown(rows, nproc)
    print("\n" + table)
    (output / "check_fsdp2.md").write_text(table + "\n")
    (output / "check_fsdp2.json").write_text(json.dumps({"nproc": nproc, "steps": args.steps,
                                                         "overrides": [*DEFAULTS, *args.overrides], "rows": rows},
                                                        indent=2) + "\n")
    print(f"wrote {output / 'check_fsdp2.md'} and check_fsdp2.json")
    return 1 if any(failed(row["status"]) for row in rows) else 0


def with_loss_vs_eager(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``rows`` (one train.parallel's modes), each with its final loss's relative distance from eager's."""
    eager = next((row["final_loss"] for row in rows if row["mode"] == "eager"), None)
    for row in rows:
        loss = row["final_loss"]
        row["loss_vs_eager"] = abs(loss - eager) / abs(eager) if loss is not None and eager else None
    return rows


def markdown(rows: Sequence[Dict[str, Any]], nproc: int) -> str:
    unit = next((row["unit"] for row in rows if row["throughput"] is not None), "samples/s")

    def cell(value, form: str) -> str:
        return "—" if value is None else form.format(value)

    return markdown_table(
        ["train.parallel", "mode", f"{unit} per GPU", "step ms median", "peak allocated MiB per GPU", "final loss",
         "vs eager", "status"],
        [[row["parallel"], row["mode"],
          cell(None if row["throughput"] is None else row["throughput"] / (row["world_size"] or nproc), "{:,.0f}"),
          cell(row["step_ms_median"], "{:.2f}"), cell(row["peak_allocated_mib"], "{:,.0f}"),
          cell(row["final_loss"], "{:.4f}"), cell(row["loss_vs_eager"], "{:.1e}"), row["status"].replace("|", "\\|")]
         for row in rows])


if __name__ == "__main__":
    sys.exit(main())
