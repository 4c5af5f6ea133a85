"""GPT-2 small: this project against the reference trainer (scripts/reference_gpt2.py), side by
side in one call, and what each lever of issue 24 is worth.

    python scripts/bench_gpt2.py                              # micro-batches 16 and 32
    python scripts/bench_gpt2.py --batch-sizes 16,32,64 --levers
    python scripts/bench_gpt2.py --batch-sizes 16 --levers graphed,accuracy
    python scripts/bench_gpt2.py --batch-sizes 16 --repeats 3                # 3 pairs, alternating who goes first
    python scripts/bench_gpt2.py --batch-sizes 16 --profile 30              # and both steps profiled side by side
    python scripts/bench_gpt2.py --batch-sizes 16 --data uniform            # the project on the reference's data
    python scripts/bench_gpt2.py --autotune --inductor-cache .inductor_cache
    python scripts/bench_gpt2.py --batch-sizes 16 recipe.data.batch_size=8   # refused: the script sets it

For each micro-batch: the reference (its settings pinned in its file), then
``train.py recipe=gpt2_small graph=full_compiled`` as a user runs it (the recipe's defaults, top-1
accuracy counted included) on synthetic tokens, evaluation off. ``--levers`` adds, at the first
micro-batch, one run per lever with it undone or tried (``--levers graphed,accuracy`` names some):
the reference with the chunked linear + cross-entropy loss (``chunked``) and graphed through
graphing.GraphedStep (``graphed``); the project with its accuracy off (``accuracy``), with LayerNorm
biases (``biases``), as ``graph=full`` (model not compiled, ``full``) and ``graph=eager`` (``eager``).
``--autotune`` adds the project with ``graph.compile_mode=max_autotune_no_cudagraphs`` twice,
sharing one inductor cache (``--inductor-cache``, default a fresh directory): the first run
fills it unless it was carried in, the second finds it. Both sides are timed alike (trainer/metrics/perf.py, the
reference through scripts/lib/timing.py) over runs of ``--steps``, each reading its loss on the host every
``--log-every`` steps (train.log_every; the reference's ``loss.item()``): tokens/s = micro-batch x 1024 x the timed
steps / their wall window (the first timed step's start to the last one's end, every read between counted); the
milliseconds beside it are the median step (after warm-up and capture, a read left out).
``--repeats N`` runs the reference and the project N times each at every micro-batch, in pairs that
alternate which of the two goes first (an H200 under sustained load slows by up to 4%, so the run
that always went second would always be the warmer one): a row then gives the median of its runs and
"vs reference" the median of the pairs' ratios, with their range. ``--profile N`` then profiles both steps
at the first micro-batch, N steps each under torch.profiler (scripts/lib/kernel_profile.py reads both alike;
the project's through scripts/profile_step.py), and adds where each step's time goes: busy and idle GPU time,
kernels by kind, the GPU's power, clock and joules a step over timed steps (scripts/lib/gpu_power.py: at the
power cap two steps with the same kernels differ by their energy), and the kernels that differ most.
The reference trains on uniform random token ids; the project, as a user runs it, on the recipe's synthetic
language (4,096 distinct ids in Markov order, which it learns). What the data is changes what the kernels
compute, and at the power cap how fast they run: ``--data uniform`` has the project train on uniform random
ids too (token files written to a scratch directory, read as ``recipe.data.source=tokens``), every project run
of the call.
Prints a markdown table; writes it and the numbers to --output (default
scripts/results/gpt2_vs_reference.json and .md), every row with the commit, versions and GPU it was measured with.
A run that fails or runs past ``--timeout`` is marked in its row; the others still run and are written, and the
script exits 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.lib.comparison import (  # noqa: E402
    exit_status, provenance, provenance_line, with_provenance,
)
from scripts.lib.launch import check_overrides, gpu_name, override_key, run_or_mark  # noqa: E402
from scripts.reference_gpt2 import VOCAB  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402

CONTEXT = 1024
PROJECT = ["recipe=gpt2_small", "graph=full_compiled", "recipe.data.source=synthetic",
           "logger=none", "train.progress=false", "train.eval=false", "checkpoint.keep=1",
           "train.epochs=1000", "checkpoint.every_epochs=0", "checkpoint.every_minutes=0"]  # --steps alone ends a run
SETS = ("recipe.data.batch_size", "graph", "run_dir", "train.max_steps", "train.log_every")  # the script's, per run
LOG_EVERY = 50  # gpt2_small's train.log_every: the project as a user runs it, the reference reading as often
WARMUP = 12  # the reference's untimed steps: train.py's 11 warm-up steps and its capture
REFERENCE_LEVERS = {  # lever: (row name, the reference's arguments)
    "chunked": ("reference, chunked linear + cross-entropy", ("--loss", "chunked")),
    "graphed": ("reference, graphed (graphing.GraphedStep)", ("--graphed",)),
}
PROJECT_LEVERS = {  # lever: (row name, the project's override)
    "accuracy": ("project: accuracy off", "recipe.accuracy=false"),
    "biases": ("project: LayerNorm biases", "recipe.model.layer_norm_bias=true"),
    "full": ("project: graph=full (model not compiled)", "graph=full"),
    "eager": ("project: graph=eager (model not compiled)", "graph=eager"),
}
LEVERS = (*REFERENCE_LEVERS, *PROJECT_LEVERS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="16,32", help="micro-batches (sequences of 1024 tokens)")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps per run, the reference's included (its first 12 untimed, as train.py's warm-up "
                             "and capture): under sustained load an H200's step slows by up to 4%%, so runs of "
                             "different lengths are not comparable")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of the reference and of the project at each micro-batch, in pairs alternating "
                             "which goes first; rows give medians and the pairs' range")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile both steps at the first micro-batch, N steps each (30: enough timed steps "
                             "for the power samples), and report them side by side")
    parser.add_argument("--data", choices=("recipe", "uniform"), default="recipe",
                        help="the project's tokens: the recipe's synthetic language (as a user runs it), or uniform "
                             "random ids over the vocabulary, the reference's own data")
    parser.add_argument("--levers", nargs="?", const=",".join(LEVERS), default="",
                        help=f"one run per lever at the first micro-batch: all, or some of {', '.join(LEVERS)}")
    parser.add_argument("--autotune", action="store_true",
                        help="graph.compile_mode=max_autotune_no_cudagraphs twice, sharing an inductor cache")
    parser.add_argument("--inductor-cache", type=Path, default=None,
                        help="--autotune's inductor cache directory (kept; default: a fresh one, removed)")
    parser.add_argument("--log-every", type=int, default=LOG_EVERY,
                        help=f"both sides read their loss on the host every this many steps: train.log_every, and the "
                             f"reference's loss.item() (default {LOG_EVERY}, gpt2_small's)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--output", type=Path, default=None)
    args, cfg = script_config(parser, defaults=PROJECT)
    check_overrides(args.overrides, SETS, "bench_gpt2.py")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    levers = [name for name in args.levers.split(",") if name]
    unknown = sorted(set(levers) - set(LEVERS))
    if unknown:
        parser.error(f"--levers: no lever {', '.join(unknown)}; the levers are {', '.join(LEVERS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    mine = [o for o in args.overrides if override_key(o) in ("recipe.data.source", "recipe.data.root")]
    if args.data == "uniform" and mine:
        parser.error(f"--data uniform sets recipe.data.source and recipe.data.root itself: drop {' '.join(mine)}")
    if args.profile < 0:
        parser.error(f"--profile takes a number of steps, not {args.profile}")
    if args.log_every < 1:
        parser.error(f"--log-every must be at least 1, not {args.log_every}")
    measured = provenance(gpu_name())
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        data = uniform_tokens(Path(scratch, "uniform")) if args.data == "uniform" else []
        named = ", uniform tokens" if args.data == "uniform" else ""

        def project(name: str, batch: int, *extra: str, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
            return run_project(name + named, batch, args, [*data, *extra], Path(scratch, str(len(rows))), env)

        for batch in sizes:
            for repeat in range(args.repeats):
                pair = [lambda: run_reference("reference", batch, args),
                        lambda: project("project: full_compiled, recipe defaults", batch)]
                for run in (pair if repeat % 2 == 0 else pair[::-1]):  # who goes first alternates
                    rows.append({**run(), "repeat": repeat})
        first = sizes[0]
        for lever in levers:
            if lever in REFERENCE_LEVERS:
                name, extra = REFERENCE_LEVERS[lever]
                rows.append(run_reference(name, first, args, *extra))
            else:
                name, override = PROJECT_LEVERS[lever]
                rows.append(project(name, first, override))
        if args.autotune:
            cache = args.inductor_cache or Path(scratch, "inductor")
            carried = cache.is_dir() and any(cache.iterdir())
            env = {"TORCHINDUCTOR_CACHE_DIR": str(cache.resolve())}
            for turn in ("carried cache" if carried else "cold cache", "warm cache"):
                rows.append(project(f"project: max_autotune_no_cudagraphs, {turn}", sizes[0],
                                    "graph.compile_mode=max_autotune_no_cudagraphs", env=env))
        profiles = None
        if args.profile:
            profiles = {"reference": profile_reference(sizes[0], args),
                        "project": profile_project(sizes[0], args, Path(scratch, "profile"), data)}
    summary = with_provenance(combined(rows), measured)
    table = markdown(summary) + "\n\n" + provenance_line(measured)
    if profiles:
        failed = {side: p["status"] for side, p in profiles.items() if p["status"] != "ok"}
        table += "\n\n" + ("\n".join(f"The {side}'s profile {status}" for side, status in failed.items()) if failed
                            else profile_markdown(profiles["reference"], profiles["project"]))
    print(table)
    output = args.output or REPO / "scripts" / "results" / "gpt2_vs_reference.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"data": args.data, "log_every": args.log_every, "provenance": measured,
                                  "rows": summary, "runs": rows, **({"profiles": profiles} if profiles else {})},
                                 indent=2) + "\n")
    output.with_suffix(".md").write_text(table + "\n")
    profiled = [(f"{side}, profiled", p["status"]) for side, p in (profiles or {}).items()]
    return exit_status("bench_gpt2.py", [*((run["name"], run["status"]) for run in rows), *profiled])


def run_reference(name: str, batch: int, args, *extra: str) -> Dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "scripts/reference_gpt2.py", "--batch-size", str(batch), "--warmup", str(WARMUP),
                   "--steps", str(args.steps - WARMUP), "--log-every", str(args.log_every), "--output", out.name,
                   *extra]
        wall, status = run_or_mark("bench_gpt2", name, command, args.timeout)
        result = json.loads(Path(out.name).read_text()) if status == "ok" else {}
    return {"name": name, "batch_size": batch, "status": status, "step_ms": result.get("step_ms_median"),
            "tokens_per_s": result.get("tokens_per_s"), "wall_window_s": result.get("wall_s"),
            "mfu_pct": result.get("mfu_pct"), "peak_allocated_mib": result.get("peak_allocated_mib"),
            "power": result.get("power"), "wall_s": wall, "command": " ".join(command[1:-2])}


def uniform_tokens(folder: Path, sequences: int = 8192, seed: int = 0) -> List[str]:
    """Token files (recipes/tokens.py) of ids drawn uniformly over the reference's vocabulary, as its own random
    batches are: ``sequences`` training windows of CONTEXT tokens and 16 for evaluation. Returns the overrides
    that have the project train on them."""
    import numpy as np

    from recipes.tokens import META, SPLIT_FILES, dtype_for_vocab

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = dtype_for_vocab(VOCAB)
    counts = dict(zip(SPLIT_FILES, (sequences * CONTEXT + 1, 16 * CONTEXT + 1)))
    for name, count in counts.items():
        rng.integers(0, VOCAB, size=count, dtype=dtype).tofile(folder / name)
    (folder / META).write_text(json.dumps({
        "tokenizer": "uniform random ids (scripts/bench_gpt2.py --data uniform)", "vocab_size": VOCAB,
        "dtype": dtype, "tokens": counts, "sources": []}, indent=2) + "\n")
    return ["recipe.data.source=tokens", f"recipe.data.root={folder}", f"recipe.data.train_size={sequences}",
            "recipe.data.test_size=16"]


def run_project(name: str, batch: int, args, extra: List[str], run_dir: Path,
                env: Optional[Dict[str, str]]) -> Dict[str, Any]:
    command = [sys.executable, "train.py", *args.train_options, *PROJECT, *args.overrides, *extra,
               f"recipe.data.batch_size={batch}", f"train.max_steps={args.steps}",
               f"train.log_every={args.log_every}", f"run_dir={run_dir}"]
    wall, status = run_or_mark("bench_gpt2", name, command, args.timeout, env)
    result = json.loads((run_dir / "results.json").read_text()) if status == "ok" else {}
    return {"name": name, "batch_size": batch, "status": status, "step_ms": result.get("perf/step_ms_median"),
            "tokens_per_s": result.get("perf/wall_tokens_per_s"), "wall_window_s": result.get("perf/wall_s"),
            "mfu_pct": result.get("perf/wall_mfu_pct"),
            "peak_allocated_mib": result.get("perf/peak_allocated_mib"), "wall_s": wall,
            "command": " ".join(c for c in command[1:-1])}


PROFILED = ("step_ms", "power", "gpu_busy_ms", "kernel_ms", "gpu_ops_per_step", "kinds", "idle_ms", "idle_gaps",
            "top_kernels")  # what a side's profile keeps


def profile_reference(batch: int, args) -> Dict[str, Any]:
    """The reference at ``batch``: its usual run with the power sampled, then ``args.profile`` steps profiled
    (reference_gpt2.py)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "scripts/reference_gpt2.py", "--batch-size", str(batch), "--warmup", str(WARMUP),
                   "--steps", str(args.steps - WARMUP), "--log-every", str(args.log_every), "--profile-steps",
                   str(args.profile), "--power", "--output", out.name]
        _, status = run_or_mark("bench_gpt2", "reference, profiled", command, args.timeout)
        if status != "ok":
            return {"status": status}
        result = json.loads(Path(out.name).read_text())
    found = {**result["profile"], "step_ms": result["step_ms_median"], "power": result.get("power")}
    return {"status": status, **{key: found.get(key) for key in PROFILED}}


def profile_project(batch: int, args, folder: Path, data: List[str]) -> Dict[str, Any]:
    """The project at ``batch`` through scripts/profile_step.py: ``args.profile`` steps to settle, as many timed
    (with the power sampled), as many profiled."""
    out = folder / "profile.json"
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "scripts/profile_step.py", "--steps", str(args.profile), "--power", "--top", "80",
               "--gaps", "8", "--output", str(out), *args.train_options, *PROJECT, *args.overrides, *data,
               f"recipe.data.batch_size={batch}", f"run_dir={folder / 'run'}"]
    _, status = run_or_mark("bench_gpt2", "project, profiled", command, args.timeout)
    if status != "ok":
        return {"status": status}
    result = json.loads(out.read_text())
    return {"status": status, **{key: result.get(key) for key in PROFILED}}


def profile_markdown(reference: Dict[str, Any], project: Dict[str, Any], differing: int = 15) -> str:
    """Both profiled steps side by side (``profile_reference``, ``profile_project``), then the ``differing``
    kernels whose time per step differs most (scripts/lib/kernel_profile.kernel_diff)."""
    from scripts.lib.kernel_profile import kernel_diff

    sides = (reference, project)

    def power(side: Dict[str, Any], key: str) -> Optional[float]:
        return (side.get("power") or {}).get(key)

    def row(name: str, values, form: str = "{:.2f}") -> str:
        return f"| {name} | " + " | ".join(_shown(v, form) for v in values) + " |"

    kinds = list(dict.fromkeys(k["kind"] for side in sides for k in side.get("kinds") or []))
    ms_of = [{k["kind"]: k["ms_per_step"] for k in side.get("kinds") or []} for side in sides]
    lines = ["Where the step goes, profiled (ms a step; kinds overlap across streams):", "",
             "| | reference | project |", "|---|---|---|",
             row("step (timed)", [s.get("step_ms") for s in sides]),
             row("GPU busy", [s.get("gpu_busy_ms") for s in sides]),
             row("GPU idle (no kernel running, profiled)", [s.get("idle_ms") for s in sides]),
             row("kernels a step", [s.get("gpu_ops_per_step") for s in sides], "{:,.0f}"),
             *(row(kind, [m.get(kind) for m in ms_of]) for kind in kinds),
             row("power (W, median over timed steps)", [power(s, "power_w") for s in sides], "{:.0f}"),
             row("SM clock (MHz, median)", [power(s, "sm_clock_mhz") for s in sides], "{:.0f}"),
             row("samples at the power cap", [power(s, "power_capped_fraction") for s in sides], "{:.0%}"),
             row("energy a step (J)", [power(s, "joules_per_step") for s in sides])]
    lines += ["", "The kernels whose time differs most (ms a step, launches a step; '—': not among that side's "
              "busiest):", "", "| kernel | reference | project | project - reference |", "|---|---|---|---|"]
    for k in kernel_diff(reference.get("top_kernels") or [], project.get("top_kernels") or [], differing):
        cells = [f"{_shown(k[f'{side}_ms'], '{:.3f}')} ({_shown(k[f'{side}_per_step'], '{:.0f}')}x)"
                 if k[f"{side}_ms"] is not None else "—" for side in ("first", "second")]
        lines.append(f"| {k['name'][:90]} | {cells[0]} | {cells[1]} | {k['diff_ms']:+.3f} |")
    return "\n".join(lines)


def combined(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per run name and micro-batch, in the order first run: the median of its runs' tokens/s (each from
    its wall window), step times, MFU and wall time, the highest peak memory, ``runs`` how many, ``status`` ok or
    how many failed and the first one's reason (a failed run counts in no number). ``vs_reference``: its tokens/s
    over the reference's at the micro-batch; where both ran in repeated pairs, the median of the pairs' ratios
    (the project's repeat i over the reference's repeat i) and ``vs_range`` their lowest and highest."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["name"], run["batch_size"]), []).append(run)
    ok = {key: [r for r in group if r.get("status", "ok") == "ok"] for key, group in groups.items()}
    tokens = {key: median([r["tokens_per_s"] for r in done]) for key, done in ok.items()}
    reference = {batch: {r.get("repeat"): r["tokens_per_s"] for r in ok[(name, batch)]}
                 for (name, batch) in groups if name == "reference"}
    rows = []
    for (name, batch), group in groups.items():
        done = ok[(name, batch)]
        failed = [r for r in group if r.get("status", "ok") != "ok"]
        row = {**group[0], "step_ms": median([r["step_ms"] for r in done]), "tokens_per_s": tokens[(name, batch)],
               "runs": len(group),
               "status": "ok" if not failed else f"{len(done)} of {len(group)} ok; {failed[0]['status']}",
               "mfu_pct": median([r["mfu_pct"] for r in done if r.get("mfu_pct") is not None]),
               "peak_allocated_mib": max((r["peak_allocated_mib"] for r in done
                                          if r.get("peak_allocated_mib") is not None), default=None),
               "wall_s": median([r["wall_s"] for r in group])}
        row.pop("repeat", None)
        theirs = reference.get(batch, {})
        pairs = [r["tokens_per_s"] / theirs[r["repeat"]] for r in done if r.get("repeat") in theirs]
        if len(pairs) > 1 and name != "reference":
            row["vs_reference"], row["vs_range"] = median(pairs), [min(pairs), max(pairs)]
        elif tokens.get(("reference", batch)) and row["tokens_per_s"]:  # over the reference's median run's
            row["vs_reference"] = row["tokens_per_s"] / tokens[("reference", batch)]
        rows.append(row)
    return rows


def median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def markdown(rows: List[Dict[str, Any]]) -> str:
    """One line per row of ``combined``: with repeated pairs, medians and the range of the pairs' ratios."""
    repeated = any(r["runs"] > 1 for r in rows)
    lines = ["| run | micro-batch | " + ("runs | " if repeated else "") + "ms/step (median) | tokens/s (wall window) | "
             "vs reference | MFU | peak MiB | wall s | status |",
             "|---|---|" + ("---|" if repeated else "") + "---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = _shown(r.get("vs_reference"), "{:.3f}x")
        if r.get("vs_range"):
            ratio += " ({:.3f}-{:.3f})".format(*r["vs_range"])
        cells = [r["name"], str(r["batch_size"]), *([str(r["runs"])] if repeated else []),
                 _shown(r.get("step_ms"), "{:.2f}"), _shown(r.get("tokens_per_s"), "{:,.0f}"), ratio,
                 _shown(r.get("mfu_pct"), "{:.1f}%"), _shown(r.get("peak_allocated_mib"), "{:,.0f}"),
                 f"{r['wall_s']:.0f}", r.get("status", "ok").replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _shown(value: Optional[float], form: str) -> str:
    return "—" if value is None else form.format(value)


if __name__ == "__main__":
    sys.exit(main())
