"""What the stall watchdog costs a step: the same run with ``train.stall_timeout_s`` on and off (issue 63).

    python scripts/bench_watchdog.py                                  # mnist, graph=full, 1 GPU, 3 pairs
    python scripts/bench_watchdog.py --repeats 5 recipe=cifar10_resnet18 graph=full_compiled
    python scripts/bench_watchdog.py --steps 40 --repeats 1 graph=eager train.precision=fp32      # on a CPU

Each run is ``torchrun --standalone --nproc_per_node=1 train.py`` (the watchdog runs under torchrun only), on
synthetic data with evaluation and checkpoints off, ``--steps`` steps; the two settings alternate (on, off, on,
off, ...), so that a drift of the machine falls on both. A run's throughput is its own wall window over its timed
steps (results.json ``perf/wall_samples_per_s``, trainer/metrics/perf.py); the ratio column is each pair's on over
off, and the summary row the median of the pairs'. Writes --output (JSON) and a Markdown table beside it, with
the commit, versions and GPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.lib.comparison import provenance, provenance_line  # noqa: E402
from scripts.lib.launch import check_overrides, cuda_device_count, gpu_name, train_launcher  # noqa: E402
from scripts.lib.train_runs import train_results  # noqa: E402
from trainer.metrics.results import markdown_table, write_json  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402

SCRIPT = "bench_watchdog.py"
SETTINGS = {"on": "60", "off": "null"}  # train.stall_timeout_s: the default, and none
DEFAULTS = ["recipe=mnist", "graph=full", "recipe.data.source=synthetic", "train.eval=false", "checkpoint.save=false",
            "logger=none", "train.progress=false"]
SETS = ("train.stall_timeout_s", "train.max_steps", "run_dir")  # this script's own: refused as overrides


def run_once(setting: str, steps: int, args: argparse.Namespace, work: Path, index: int) -> Dict[str, Any]:
    run_dir = work / f"{index:02d}_{setting}"
    command = [*train_launcher(1, torchrun=True), *args.train_options, *DEFAULTS, *args.overrides,
               f"train.max_steps={steps}", f"train.stall_timeout_s={SETTINGS[setting]}", f"run_dir={run_dir}"]
    r = train_results(SCRIPT, f"the run with the watchdog {setting}", command, run_dir, args.timeout)
    return {"setting": setting, "stall_timeout_s": SETTINGS[setting], "samples_per_s": r["perf/wall_samples_per_s"],
            "step_ms_median": r["perf/step_ms_median"], "steps_timed": r["perf/wall_steps"], "mode": r["mode"]}


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(prog=SCRIPT, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000, help="steps a run (3000)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs, on then off (3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (300)")
    parser.add_argument("--output", type=Path, default=ROOT / "scripts" / "results" / "watchdog_overhead.json")
    args, _ = script_config(parser, argv, defaults=DEFAULTS)  # composed once: a bad override is said before any run
    check_overrides(args.overrides, SETS, SCRIPT)
    if args.steps < 30 or args.repeats < 1:
        parser.error("--steps must be at least 30 (the first steps are not timed) and --repeats at least 1")
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_watchdog_") as work:
        for i in range(args.repeats):
            for setting in ("on", "off"):
                rows.append(run_once(setting, args.steps, args, Path(work), len(rows)))
                print(f"{SCRIPT}: {setting}: {rows[-1]['samples_per_s']:.0f} samples/s, median step "
                      f"{rows[-1]['step_ms_median']:.3f} ms", flush=True)
    ratios = [on["samples_per_s"] / off["samples_per_s"] for on, off in zip(rows[::2], rows[1::2])]
    measured = provenance(gpu_name() if cuda_device_count() else "CPU")
    table = markdown_table(
        ["pair", "watchdog", "train.stall_timeout_s", "samples/s (wall)", "median step ms", "on / off"],
        [[i // 2 + 1, row["setting"], row["stall_timeout_s"], round(row["samples_per_s"]),
          round(row["step_ms_median"], 4), round(ratios[i // 2], 4) if row["setting"] == "on" else ""]
         for i, row in enumerate(rows)]
        + [["median", "", "", "", "", round(statistics.median(ratios), 4)]])
    command = " ".join(["python", f"scripts/{SCRIPT}", f"--steps {args.steps}", f"--repeats {args.repeats}",
                        *args.train_options, *args.overrides])
    text = (f"{table}\n\n{len(rows)} runs of `{' '.join(DEFAULTS + list(args.overrides))}`, {args.steps} steps each, "
            f"alternating; `{command}`. {provenance_line(measured)}\n")
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, {"rows": rows, "ratios_on_over_off": ratios, "median_ratio": statistics.median(ratios),
                             "command": command, "provenance": measured})
    args.output.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
