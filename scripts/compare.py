"""Compare graph modes across separate runs: same config, one mode per run.

    python scripts/compare.py                                   # all modes, every GPU
    python scripts/compare.py --modes eager,full --nproc 2 -- recipe=mnist train.max_steps=500
    python scripts/compare.py --nproc 1 -- experiment=debug     # a CPU smoke test

Each mode runs as its own job (torchrun when --nproc > 1, plain python otherwise),
one after another, with identical train.py arguments apart from ``graph=<mode>``: the
overrides (after ``--``), and ``--config-dir``/``--config-name`` when given. The runs land
in ``<output>/runs/<mode>/`` and share one W&B group (the comparison's name), with the
mode as job_type. Then this script reads every run's results.json and writes, into
``<output>``:

    compare.md     the Markdown table it also prints
    compare.json   the table's rows and every run's full results
    compare.png    samples/s and speedup vs eager per mode

and logs one more W&B run (job_type "compare") with the table and the chart.
Speedup is samples/s (tokens/s for language models) of a mode over that of eager.
Across runs that is a fair comparison only because everything but the mode is held
fixed; `graph.compare=true` gives the same-process comparison (see docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as `python scripts/compare.py`: find conf/ and scripts/

from scripts.lib.comparison import log_to_wandb, save_comparison  # noqa: E402
from scripts.lib.launch import (  # noqa: E402
    RESERVED, check_overrides, cuda_device_count, exit_on_sigterm, failed, graph_names, parse_list, run_modes,
    timestamp,
)
from trainer.run.cli import script_config  # noqa: E402

MODES = ("eager", "full", "partial", "compile", "full_compiled")  # conf/graph/<mode>.yaml


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run train.py once per graph mode with the same config and compare the results.",
        epilog="train.py's overrides for every run go after '--', e.g. -- recipe=mnist train.max_steps=500; "
               "--config-dir and --config-name go to every run too.")
    parser.add_argument("--modes", type=lambda s: parse_list(s, graph_names(), "mode"), default=list(MODES),
                        help=f"comma-separated conf/graph names (default: {','.join(MODES)})")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes per run: torchrun when > 1 (default: the CUDA GPU count, or 1)")
    parser.add_argument("--output", type=Path, default=None,
                        help="comparison directory (default: outputs/compare/<timestamp>)")
    parser.add_argument("--name", default=None, help="W&B group of the runs (default: the output directory's name)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is stopped")
    opts, cfg = script_config(parser, argv)  # a typo fails here once, not once per mode
    check_overrides(opts.overrides, RESERVED, "compare.py")
    train_args = [*opts.train_options, *opts.overrides]
    exit_on_sigterm()

    gpus = cuda_device_count()
    nproc = max(gpus, 1) if opts.nproc is None else opts.nproc
    if nproc < 1:
        parser.error(f"--nproc={nproc} must be at least 1")
    output = (opts.output or ROOT / "outputs" / "compare" / timestamp()).resolve()
    name = opts.name or output.name
    output.mkdir(parents=True, exist_ok=True)
    print(f"comparing {', '.join(opts.modes)} with {nproc} process{'es' * (nproc > 1)} "
          f"on {'CUDA' if gpus else 'CPU'} into {output}")

    outcomes = run_modes(opts.modes, nproc, train_args, output, group=name, timeout=opts.timeout, cuda=gpus > 0)
    saved = save_comparison(output, name, outcomes, nproc, train_args)
    print("\n" + saved["markdown"])
    rows = saved["rows"]
    log_to_wandb(cfg.logger, output, group=name, job_type="compare", name=f"{name}-compare",
                 config={"modes": opts.modes, "nproc": nproc, "train_args": train_args, "recipe": cfg.recipe.name},
                 table_key="comparison", rows=rows, images={"comparison_chart": saved["plot"]},
                 summary={f"speedup/{row['mode']}": row["speedup"] for row in rows if row["speedup"] is not None})
    print(f"wrote {output / 'compare.md'}, compare.json, compare.png")
    return 1 if any(failed(row["status"]) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
