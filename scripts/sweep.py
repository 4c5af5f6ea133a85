"""Speedup of graph modes vs batch size (and vs GPU count), per recipe.

    python scripts/sweep.py                                  # eager vs full, 16..256, every recipe
    python scripts/sweep.py --nprocs 1,2 --batch-sizes 32,128 -- train.max_steps=300
    python scripts/sweep.py --batch-sizes 16,32 -- experiment=debug   # CPU: eager only

For every recipe, process count and batch size (per rank) this runs one comparison
(scripts/compare.py: eager and full by default) into ``<output>/<recipe>_n<N>_bs<B>/``,
then writes into ``<output>``:

    sweep.json           every point: recipe, nproc, batch size, mode, throughput, speedup, status
    sweep.md             the same as a table
    sweep_<recipe>.png   speedup vs batch size (one line per GPU count) and throughput

and logs one W&B run (job_type "sweep") in the group of all the sweep's runs. Without
CUDA the graph modes are recorded as not available and only eager runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.lib.comparison import MISSING, format_cell, log_to_wandb, save_comparison, save_figure  # noqa: E402
from scripts.lib.launch import (  # noqa: E402
    RESERVED, check_overrides, cuda_device_count, exit_on_sigterm, failed, graph_names, parse_list, run_modes,
    timestamp,
)
from trainer.run.cli import script_config  # noqa: E402
from trainer.metrics.results import markdown_table, write_json  # noqa: E402

DEFAULT_BATCH_SIZES = "16,32,64,128,256"
SWEEP_RESERVED = (*RESERVED, "recipe", "recipe.data.batch_size")


def recipe_names(config_dir: Optional[str] = None) -> List[str]:
    """The recipe= choices: conf/recipe/*.yaml, and the user's DIR/recipe/*.yaml with --config-dir DIR."""
    dirs = [ROOT / "conf"] + ([Path(config_dir)] if config_dir else [])
    return sorted({p.stem for d in dirs for p in (d / "recipe").glob("*.yaml")})


def chosen_recipes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> List[str]:
    """--recipes, each a recipe= choice (default: every one)."""
    names = recipe_names(args.config_dir)
    if args.recipes is None:
        return names
    try:
        return parse_list(args.recipes, names, "recipe")
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument --recipes: {e}")


def parse_ints(text: str) -> List[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 16,32,64")
    return values


def sweep(recipes: Sequence[str], nprocs: Sequence[int], batch_sizes: Sequence[int], modes: Sequence[str],
          train_args: Sequence[str], output: Path, *, name: str, timeout: float, cuda: bool) -> List[Dict[str, Any]]:
    """Runs one comparison per (recipe, nproc, batch size); returns one point per mode of each.

    ``train_args``: train.py's ``--config-dir``/``--config-name`` (first), then the overrides.
    """
    points = []
    for recipe in recipes:
        for nproc in nprocs:
            for batch_size in batch_sizes:
                label = f"{recipe}_n{nproc}_bs{batch_size}"
                print(f"== {recipe}: {nproc} process{'es' * (nproc > 1)}, batch size {batch_size} per rank")
                point_args = [*train_args, f"recipe={recipe}", f"recipe.data.batch_size={batch_size}"]
                outcomes = run_modes(modes, nproc, point_args, output / label, group=name,
                                     run_name=f"{name}-{label}", timeout=timeout, cuda=cuda)
                rows = save_comparison(output / label, label, outcomes, nproc, point_args)["rows"]
                points += [{"recipe": recipe, "nproc": nproc, "batch_size": batch_size, **row} for row in rows]
    return points


def sweep_table(points: Sequence[Dict[str, Any]], modes: Sequence[str]) -> str:
    """Markdown: one line per (recipe, nproc, batch size), throughput per mode, speedup per graph mode."""
    graph_modes = [m for m in modes if m != "eager"]
    unit = points[0]["unit"] if points else "samples/s"
    headers = ["recipe", "nproc", "batch size/rank", *(f"{m} {unit}" for m in modes),
               *(f"speedup {m}" for m in graph_modes)]
    rows = []
    for key in sorted({(p["recipe"], p["nproc"], p["batch_size"]) for p in points}):
        by_mode = {p["mode"]: p for p in points if (p["recipe"], p["nproc"], p["batch_size"]) == key}
        cells = [*map(str, key)]
        cells += [format_cell(by_mode[m]["throughput"], "{:,.0f}") if m in by_mode else MISSING for m in modes]
        cells += [format_cell(by_mode[m]["speedup"], "{:.2f}x") if m in by_mode else MISSING for m in graph_modes]
        rows.append(cells)
    return markdown_table(headers, rows)


def plot_sweep(points: Sequence[Dict[str, Any]], path: Path, title: str = "", cuda: bool = True) -> Path:
    """Left: speedup vs batch size, one line per GPU count (and graph mode). Right: throughput."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(nproc: int, mode: str) -> str:
        return f"{mode}, {nproc} {'GPU' if cuda else 'proc'}{'s' * (nproc > 1)}"

    nprocs = sorted({p["nproc"] for p in points})
    modes = list(dict.fromkeys(p["mode"] for p in points))
    batch_sizes = sorted({p["batch_size"] for p in points})
    markers = dict(zip(modes, "osD^vP*X"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for color, nproc in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], nprocs):
        for mode in modes:
            line = sorted((p["batch_size"], p) for p in points if p["nproc"] == nproc and p["mode"] == mode)
            style = dict(color=color, marker=markers[mode], linestyle="-" if mode == "eager" else "--",
                         label=label(nproc, mode))
            for ax, key in ((right, "throughput"), (left, "speedup")):
                measured = [(b, p[key]) for b, p in line if p[key] is not None]
                if measured and not (ax is left and mode == "eager"):  # eager's speedup is 1 by definition
                    ax.plot(*zip(*measured), **style)
    if not left.lines:  # no graph point anywhere, e.g. on CPU: say why instead of an empty frame
        reasons = sorted({p["status"] for p in points if p["mode"] != "eager" and p["speedup"] is None})
        left.text(0.5, 0.5, "no speedup points:\n" + "\n".join(reasons or ["no graph mode requested"]),
                  ha="center", va="center", transform=left.transAxes, wrap=True)
    left.axhline(1.0, color="gray", linestyle=":", linewidth=1)  # drawn after the check above
    unit = points[0]["unit"] if points else "samples/s"
    for ax, ylabel in ((left, "speedup vs eager"), (right, unit)):
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(batch_sizes, default=1) / 1.4, max(batch_sizes, default=1) * 1.4)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size per rank")
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Speedup of graph modes vs batch size and GPU count: one comparison per point.",
        epilog="train.py's overrides for every run go after '--', e.g. -- train.max_steps=300; "
               "--config-dir and --config-name go to every run too.")
    parser.add_argument("--recipes", default=None,
                        help="comma-separated recipe names: conf/recipe/*.yaml, and DIR/recipe/*.yaml with "
                             "--config-dir DIR (default: all)")
    parser.add_argument("--batch-sizes", type=parse_ints, default=parse_ints(DEFAULT_BATCH_SIZES),
                        help=f"per-rank batch sizes (default: {DEFAULT_BATCH_SIZES})")
    parser.add_argument("--nprocs", type=parse_ints, default=None,
                        help="process counts, e.g. 1,2 (default: 1, and every GPU when there are several)")
    parser.add_argument("--modes", type=lambda s: parse_list(s, graph_names(), "mode"), default=["eager", "full"],
                        help="comma-separated conf/graph names; include eager for speedups (default: eager,full)")
    parser.add_argument("--output", type=Path, default=None,
                        help="sweep directory (default: outputs/sweep/<timestamp>)")
    parser.add_argument("--name", default=None, help="W&B group of all runs (default: the output directory's name)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is stopped")
    # The first recipe's config: a typo in the overrides fails here once, not once per run.
    opts, cfg = script_config(parser, argv, defaults=lambda a: [f"recipe={chosen_recipes(parser, a)[0]}"])
    check_overrides(opts.overrides, SWEEP_RESERVED, "sweep.py")
    recipes = chosen_recipes(parser, opts)
    train_args = [*opts.train_options, *opts.overrides]
    exit_on_sigterm()
    gpus = cuda_device_count()
    nprocs = opts.nprocs or [1] + ([gpus] if gpus > 1 else [])

    output = (opts.output or ROOT / "outputs" / "sweep" / timestamp()).resolve()
    name = opts.name or output.name
    output.mkdir(parents=True, exist_ok=True)

    points = sweep(recipes, nprocs, opts.batch_sizes, opts.modes, train_args, output,
                   name=name, timeout=opts.timeout, cuda=gpus > 0)
    write_json(output / "sweep.json", {"name": name, "recipes": recipes, "nprocs": nprocs,
                                       "batch_sizes": opts.batch_sizes, "modes": opts.modes,
                                       "train_args": train_args, "points": points})
    table = sweep_table(points, opts.modes)
    (output / "sweep.md").write_text(f"## Sweep `{name}`\n\n{table}\n")
    plots = {f"sweep_{recipe}": plot_sweep([p for p in points if p["recipe"] == recipe],
                                           output / f"sweep_{recipe}.png", title=f"{name}: {recipe}", cuda=gpus > 0)
             for recipe in recipes}
    print("\n" + table + "\n")
    log_to_wandb(cfg.logger, output, group=name, job_type="sweep", name=f"{name}-sweep",
                 config={"recipes": recipes, "nprocs": nprocs, "batch_sizes": opts.batch_sizes,
                         "modes": opts.modes, "train_args": train_args},
                 table_key="sweep", rows=points, images=plots, summary={})
    print(f"wrote {output / 'sweep.json'}, sweep.md, {', '.join(p.name for p in plots.values())}")
    return 1 if any(failed(p["status"]) for p in points) else 0


if __name__ == "__main__":
    sys.exit(main())
