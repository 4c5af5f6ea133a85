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
fixed; `graph.compare=true` gives the same-process comparison (see README).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as `python scripts/compare.py`: find conf/ and scripts/

from trainer import results  # noqa: E402
from trainer.cli import script_config  # noqa: E402

MODES = ("eager", "full", "partial", "compile", "full_compiled")  # conf/graph/<mode>.yaml
CPU_MODES = ("eager", "auto")  # every other mode needs a CUDA GPU
NOT_AVAILABLE = "not available (no CUDA)"
# Overrides this script sets per run; a user value would silently break the comparison.
RESERVED = ("graph", "graph.mode", "graph.compile_model", "output_root", "run_dir",
            "logger.wandb.group", "logger.wandb.job_type", "logger.wandb.name")


# ---- launching one run per mode -------------------------------------------------------

def cuda_device_count() -> int:
    import torch  # here, so `--help` stays fast
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def hydra_value(value: str) -> str:
    """``value`` as a Hydra override value: quoted unless it is plainly safe."""
    if re.fullmatch(r"[\w./-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def check_overrides(overrides: Sequence[str], reserved: Sequence[str], script: str) -> None:
    """Exits with a message naming the override that the script sets itself."""
    for override in overrides:
        if override_key(override) in reserved:
            sys.exit(f"{script}: {override!r} is set by this script for every run: drop it "
                     f"and use the script's options instead (see {script} --help)")


def train_launcher(nproc: int, torchrun: bool = False) -> List[str]:
    """How train.py starts: torchrun for nproc > 1 (or when asked: DDP with one rank), plain python otherwise."""
    if nproc > 1 or torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    return [sys.executable, "train.py"]


def run_or_exit(script: str, name: str, command: Sequence[str], timeout: float,
                env: Optional[Dict[str, str]] = None) -> float:
    """A benchmark's one run: says the command, runs it in the repo, exits naming the run and the
    end of its stderr if it fails; returns its wall time in seconds."""
    print(f"{script}: {name}: {' '.join(command[1:])}", flush=True)
    started = time.time()
    done = subprocess.run(list(command), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        sys.exit(f"{script}: '{name}' failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.time() - started


def command(mode: str, nproc: int, train_args: Sequence[str], output_root: Path, group: str,
            run_name: str) -> List[str]:
    """The train.py command line of one run (``train_launcher``).

    ``train_args``: train.py's ``--config-dir``/``--config-name`` (first), then the overrides.
    """
    return [*train_launcher(nproc), *train_args, f"graph={mode}", f"output_root={hydra_value(str(output_root))}",
            f"logger.wandb.group={hydra_value(group)}", f"logger.wandb.job_type={mode}",
            f"logger.wandb.name={hydra_value(f'{run_name}-{mode}')}"]


def last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_dirs(root: Path) -> set:
    return {p.parent for p in root.rglob("rank0.log")}  # every run directory has one


def launch_mode(mode: str, nproc: int, train_args: Sequence[str], output: Path, *, group: str,
                run_name: str, timeout: float, cuda: bool) -> Dict[str, Any]:
    """Runs one mode to the end; returns its outcome: status, exit code, run_dir, results."""
    outcome: Dict[str, Any] = {"mode": mode, "status": "", "exit_code": None, "seconds": 0.0,
                               "run_dir": None, "results": {}}
    if not cuda and mode not in CPU_MODES:
        outcome["status"] = NOT_AVAILABLE
        return outcome
    root = output / "runs" / mode
    root.mkdir(parents=True, exist_ok=True)
    before = run_dirs(root)
    cmd = command(mode, nproc, train_args, root, group, run_name)
    (root / "command.txt").write_text(" ".join(cmd) + "\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(root / "stdout.log", "w") as out, open(root / "stderr.log", "w") as err:
        # A session of its own, so that a timeout stops the whole torchrun tree; an
        # interrupt (Ctrl-C, SIGTERM) of this script stops it too rather than orphaning it.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            outcome["exit_code"] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
        except BaseException:
            stop(proc)
            raise
    outcome["seconds"] = time.perf_counter() - start

    new = run_dirs(root) - before
    run_dir = max(new, key=lambda p: p.stat().st_mtime) if new else None
    results_file = run_dir / "results.json" if run_dir else None
    if run_dir:
        outcome["run_dir"] = str(run_dir)
    if outcome["exit_code"] is None:
        outcome["status"] = f"timed out after {timeout:g} s"
    elif outcome["exit_code"] != 0:
        outcome["status"] = f"failed (exit {outcome['exit_code']}): {last_line(root / 'stderr.log')}"
    elif not results_file or not results_file.exists():
        outcome["status"] = f"failed (exit 0 but no results.json under {root})"
    else:
        outcome["results"] = json.loads(results_file.read_text())
        outcome["status"] = "ok"
    return outcome


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group, SIGKILL if it is still there 10 s later."""
    if proc.poll() is not None:
        return
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def failed(status: str) -> bool:
    """A run that was launched and did not finish with results (unavailable modes are not failures)."""
    return not status.startswith(("ok", "not available"))


def run_modes(modes: Sequence[str], nproc: int, train_args: Sequence[str], output: Path, *, group: str,
              run_name: Optional[str] = None, timeout: float = 3600,
              cuda: Optional[bool] = None) -> List[Dict[str, Any]]:
    """Launches each mode in turn with the same train.py arguments; returns their outcomes in order."""
    cuda = cuda_device_count() > 0 if cuda is None else cuda
    outcomes = []
    for i, mode in enumerate(modes, 1):
        print(f"[{i}/{len(modes)}] {mode}: ", end="", flush=True)
        outcome = launch_mode(mode, nproc, train_args, output, group=group, run_name=run_name or group,
                              timeout=timeout, cuda=cuda)
        row = comparison_rows([outcome])[0]
        if row["throughput"] is not None:
            print(f"{row['status']} in {outcome['seconds']:.1f} s, {row['throughput']:,.0f} {row['unit']}")
        else:
            print(row["status"] + (f" ({outcome['seconds']:.1f} s)" if outcome["seconds"] else ""))
        outcomes.append(outcome)
    return outcomes


# ---- the table ------------------------------------------------------------------------

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
    from trainer.metrics_logger import wandb_mode

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


# ---- the command line -----------------------------------------------------------------

def parse_list(text: str, allowed: Sequence[str], what: str) -> List[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or '(none)'}: "
                                         f"choose from {', '.join(allowed)}")
    return items


def graph_names() -> List[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "graph").glob("*.yaml"))


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that the run in flight is stopped on the way out."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def timestamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


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
