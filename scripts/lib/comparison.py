"""A comparison as results: one row per run with its speedup over eager, the Markdown table, the chart, the
files and the W&B run that compare.py and sweep.py write; and what every benchmark's table shares (the
bench_*.py scripts): where its rows come from (commit, versions, GPU), the refusal to ``--append`` rows of
another, and its one exit status when a run failed.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from scripts.lib.refuse import refuse
from trainer.metrics import results

ROOT = Path(__file__).resolve().parents[2]
# The packages whose versions a benchmark row records (None where not installed); torch's first.
MEASURED_WITH = ("torch", "torchtitan", "torchao", "transformers")
COMMIT_ENV = "BENCH_COMMIT"  # the commit to record where the checkout has no .git (a copied working tree)

COLUMNS = [  # (row key, Markdown header, format)
    ("mode", "mode", "{}"),
    ("throughput", "{unit}", "{:,.0f}"),
    ("step_ms_median", "step ms median", "{:.2f}"),
    ("step_ms_p90", "step ms p90", "{:.2f}"),
    ("speedup", "speedup vs eager", "{:.2f}x"),
    ("capture_s", "capture s", "{:.2f}"),
    ("graph_pool_mib", "graph pool MiB", "{:,.1f}"),
    ("peak_allocated_mib", "peak allocated MiB", "{:,.1f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("eval_accuracy", "eval accuracy", "{:.2%}"),
    ("status", "status", "{}"),
]
MISSING = "—"


def throughput_unit(results: Dict[str, Any]) -> str:
    """'tokens/s' for language-model recipes, else 'samples/s'."""
    return "tokens/s" if "perf/tokens_per_s" in results else "samples/s"


def comparison_rows(outcomes: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per outcome; speedup = the mode's samples/s over eager's (None without eager)."""
    rows = []
    for outcome in outcomes:
        r = outcome.get("results") or {}
        unit = throughput_unit(r)
        status = outcome["status"]
        if status == "ok" and r.get("graph/fallback"):
            status = f"ok, fell back to eager: {r['graph/fallback']}"
        elif status == "ok" and r.get("timed_phase") == "warmup":
            status = "ok, only warm-up steps timed: raise train.max_steps"
        rows.append({
            "mode": outcome["mode"],
            "throughput": r.get(f"perf/{unit.replace('/s', '')}_per_s"),
            "unit": unit,
            "step_ms_median": r.get("perf/step_ms_median"),
            "step_ms_p90": r.get("perf/step_ms_p90"),
            "mfu_pct": r.get("perf/mfu_pct"),
            "speedup": None,
            "capture_s": r.get("graph/train_capture_s"),
            "graph_pool_mib": r.get("graph/graph_pool_mib"),
            "peak_allocated_mib": r.get("perf/peak_allocated_mib"),
            "final_loss": r.get("final/loss"),
            "eval_accuracy": r.get("final/eval_accuracy"),
            "world_size": r.get("world_size"),
            "status": status,
            "run_dir": outcome.get("run_dir"),
        })
    eager = next((row["throughput"] for row in rows if row["mode"] == "eager"), None)
    for row in rows:
        if eager and row["throughput"] is not None:
            row["speedup"] = row["throughput"] / eager
    return rows


def format_cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return fmt.format(value).replace("|", "\\|")  # a '|' in an error message would split the cell


def markdown_table(rows: Sequence[Dict[str, Any]]) -> str:
    unit = rows[0]["unit"] if rows else "samples/s"
    return results.markdown_table([header.format(unit=unit) for _, header, _ in COLUMNS],
                                  [[format_cell(row[key], fmt) for key, _, fmt in COLUMNS] for row in rows])


def report(name: str, rows: Sequence[Dict[str, Any]], nproc: int, train_args: Sequence[str]) -> str:
    """The Markdown that is printed and saved as compare.md."""
    launcher = f"torchrun --nproc_per_node={nproc}" if nproc > 1 else "python"
    return (f"## Comparison `{name}`\n\n"
            f"{launcher} train.py {' '.join(train_args)} graph=<mode>\n\n"
            f"{markdown_table(rows)}\n\n"
            "speedup vs eager = the mode's throughput / eager's throughput, from separate runs "
            "with the same config.\n")


# ---- saving and plotting --------------------------------------------------------------

def plot_comparison(rows: Sequence[Dict[str, Any]], path: Path, title: str = "") -> Path:
    """Bar charts of throughput and of speedup vs eager per mode; unavailable modes read 'n/a'."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [row["mode"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(rows)), 4))
    for ax, key, label, fmt in ((left, "throughput", rows[0]["unit"] if rows else "samples/s", "{:,.0f}"),
                                (right, "speedup", "speedup vs eager", "{:.2f}x")):
        values = [row[key] for row in rows]
        bars = ax.bar(modes, [v or 0 for v in values], color="tab:blue")
        for bar, v in zip(bars, values):
            ax.annotate("n/a" if v is None else fmt.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
    right.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_comparison(output: Path, name: str, outcomes: Sequence[Dict[str, Any]], nproc: int,
                    train_args: Sequence[str]) -> Dict[str, Any]:
    """Writes compare.md, compare.json and compare.png into ``output``; returns what it wrote."""
    rows = comparison_rows(outcomes)
    text = report(name, rows, nproc, train_args)
    (output / "compare.md").write_text(text)
    results.write_json(output / "compare.json", {"name": name, "nproc": nproc, "train_args": list(train_args),
                                         "rows": rows, "runs": list(outcomes)})
    plot = plot_comparison(rows, output / "compare.png", title=f"{name} ({nproc} process{'es' * (nproc > 1)})")
    return {"rows": rows, "markdown": text, "plot": plot}


# ---- W&B ------------------------------------------------------------------------------

def log_to_wandb(cfg_logger, directory: Path, *, group: str, job_type: str, name: str,
                 config: Dict[str, Any], table_key: str, rows: Sequence[Dict[str, Any]],
                 images: Dict[str, Path], summary: Dict[str, Any]) -> Optional[str]:
    """One W&B run holding ``rows`` as a table and ``images``; returns its directory, or None.

    Mode: ``logger.wandb.mode``, else WANDB_MODE, else offline (as train.py). Any failure
    only warns: the files on disk are the result.
    """
    if cfg_logger.backend.value != "wandb":
        return None
    from trainer.metrics.logger import wandb_mode

    wcfg = cfg_logger.wandb
    try:
        import wandb

        run = wandb.init(project=wcfg.project, entity=wcfg.entity, group=group, job_type=job_type, name=name,
                         tags=list(wcfg.tags), config=config, dir=str(directory), mode=wandb_mode(wcfg),
                         settings=wandb.Settings(init_timeout=wcfg.init_timeout_s, console="off", silent=True))
        try:
            columns = list(rows[0]) if rows else []
            table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
            run.log({table_key: table, **{key: wandb.Image(str(path)) for key, path in images.items()}})
            run.summary.update(summary)
        finally:
            run.finish()
        return run.dir
    except Exception as e:  # no key, no network: warn and carry on
        print(f"warning: W&B logging of the {job_type} run failed ({type(e).__name__}: {e}); "
              f"the results are in {directory}", file=sys.stderr)
        return None


# ---- every benchmark's table ----------------------------------------------------------------

def provenance(gpu: Optional[str]) -> Dict[str, Optional[str]]:
    """What a benchmark's rows were measured with: the commit (``+modified`` when tracked files differ from it),
    the versions of MEASURED_WITH (None: not installed) and the GPU's name (None: not known, a --dry-run's)."""
    return {"commit": commit(), **{package: installed(package) for package in MEASURED_WITH}, "gpu": gpu}


def commit() -> str:
    """HEAD of this checkout, ``+modified`` when a tracked file differs from it; without git, $BENCH_COMMIT."""
    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None:
        return os.environ.get(COMMIT_ENV) or f"unknown (no git checkout here: set {COMMIT_ENV})"
    changed = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+modified" if changed else "")


def installed(package: str) -> Optional[str]:
    """``package``'s version, None where it is not installed; torch's with its build (``2.11.0+cu130``)."""
    if package == "torch":
        import torch  # its metadata leaves the CUDA build out

        return torch.__version__
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_append(script: str, output: Path, measured: Dict[str, Optional[str]]) -> List[Dict[str, Any]]:
    """The rows of ``output`` (an earlier call's table) that ``--append`` keeps; refuses (exit 2) before anything
    runs when one of them was measured at another commit, with other versions or on another GPU (where this call
    knows its GPU), or records none of that."""
    if not output.is_file():
        return []
    rows = json.loads(output.read_text()).get("rows", [])
    compared = [key for key in measured if key != "gpu" or measured[key] is not None]
    for row in rows:
        theirs = row.get("provenance")
        differ = [key for key in compared if (theirs or {}).get(key) != measured[key]]
        if differ:
            said = (", ".join(f"{key} {theirs.get(key)} (now {measured[key]})" for key in differ) if theirs
                    else "no commit or versions (written before rows recorded them)")
            refuse(f"{script}: --append: {output} holds rows measured with {said}: one table holds one commit's "
                   "numbers; give another --output, or drop --append to start this table anew")
    return rows


def with_provenance(rows: Sequence[Dict[str, Any]], measured: Dict[str, Optional[str]]) -> List[Dict[str, Any]]:
    """Each row with ``provenance``: what it was measured with (a row an earlier call kept keeps its own)."""
    return [{**row, "provenance": row.get("provenance") or dict(measured)} for row in rows]


def provenance_line(measured: Dict[str, Optional[str]]) -> str:
    """One Markdown line under a table: the commit, the versions installed and the GPU."""
    versions = ", ".join(f"{package} {measured[package]}" for package in MEASURED_WITH if measured.get(package))
    return f"Measured at commit {measured['commit']} with {versions} on {measured['gpu'] or 'a GPU not named'}."


def exit_status(script: str, statuses: Sequence[Tuple[str, str]]) -> int:
    """A benchmark's exit status from its runs' (name, status): 1, naming each, when one failed or timed out (its
    row says so; the table holds the others), else 0."""
    failed = [(name, status) for name, status in statuses if not status.startswith("ok")]
    for name, status in failed:
        print(f"{script}: {name}: {status}", file=sys.stderr)
    return 1 if failed else 0
