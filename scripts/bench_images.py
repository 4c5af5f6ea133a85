"""Does JPEG decoding keep a graphed image step busy? The same step fed from a folder and from the device (issue 68).

    python scripts/make_image_folder.py --output /data/photos --classes 100 --per-class 400 --val   # 157 steps an epoch
    python scripts/bench_images.py --root /data/photos                         # resnet50 and vit_b_16, full
    python scripts/bench_images.py --root /data/photos --models resnet50 --graphs full full_compiled --repeats 3
    python scripts/bench_images.py --root /tmp/tiny --models resnet18 --image-size 64 --batch 8 --steps 30 \\
        --graphs eager train.precision=fp32                                     # a CPU, to try it

For each model and graph mode, ``train.py recipe=torchvision_classifier`` runs twice, alternating, ``--repeats``
times: ``recipe.data.source=folder`` (random-resized crops decoded by the host loader's workers: Pillow, every core
but one by default) and ``recipe.data.source=synthetic`` (images held on the GPU: the step with no input cost). The
ratio column is each pair's folder run over its synthetic run, images per second from each run's own wall window
over its timed steps (results.json ``perf/wall_samples_per_s``: every input wait inside it). Each row also
records the start-up to the first step, the peak host memory of the whole run, loader workers included, the
share of the loop spent waiting for the workers (results.json ``time/input_wait_s``, warm-up's first batches too)
and of the timed steps' wall window (``perf/wall_input_wait_s``: the steady state's), and the cores the run kept
busy over its timed steps, with the training process's own share in brackets: all of the machine's cores busy and a
wait says the decoding ran short of cores (scripts/lib/train_runs.py). Evaluation and checkpoints are
off. Writes --output (JSON) and a Markdown table beside it, with the commit, versions and GPU.

``--references DIR``: also torchvision's own ``references/classification/train.py`` from DIR (a checkout of the
torchvision repository's references/classification matching the installed torchvision; no wheel carries it),
unmodified, as its README runs it (``--amp``, ``--workers`` as this repo's), on the same folder (it reads
``train/`` and ``val/``: ``make_image_folder.py --val``), model and batch, timed by scripts/time_steps.py over
the same number of optimizer steps as this repo's timed window, after 20 untimed: its own img/s meter starts after
each batch arrives and so leaves loading out, the wall window does not. Its host memory and busy cores are read as
this repo's are. The ratio column of its row is this repo's folder-fed run over it. The references evaluate and save
a checkpoint at each epoch's end and start new loader workers: a folder whose epoch is shorter than the references'
steps puts that inside their window (said when it does); an epoch of ImageNet is 5,005 steps of 256.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.lib.comparison import provenance, provenance_line  # noqa: E402
from scripts.lib.launch import check_overrides, cuda_device_count, gpu_name, train_launcher  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402
from scripts.lib.train_runs import measured_run, train_results  # noqa: E402
from trainer.metrics.results import markdown_table, write_json  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402

SCRIPT = "bench_images.py"
DEFAULTS = ["recipe=torchvision_classifier", "train.eval=false", "checkpoint.save=false", "logger=none",
            "train.progress=false", "train.epochs=1000"]
SOURCES = ("folder", "synthetic")
REFERENCE_UNTIMED = 20  # the references' optimizer steps before their window (cudnn.benchmark's first trials)
# Set by this script for every run: refused as overrides.
SETS = ("recipe", "recipe.model.name", "recipe.model.image_size", "recipe.data.source", "recipe.data.root",
        "recipe.data.batch_size", "recipe.data.num_workers", "graph", "train.max_steps", "run_dir")


def run_once(args: argparse.Namespace, model: str, graph: str, source: str, work: Path, index: int) -> Dict[str, Any]:
    run_dir = work / f"{index:02d}_{model}_{graph}_{source}"
    command = [*train_launcher(1), *args.train_options, *DEFAULTS, *args.overrides, f"recipe.model.name={model}",
               f"recipe.model.image_size={args.image_size}", f"recipe.data.source={source}",
               f"recipe.data.root={args.root}", f"recipe.data.batch_size={args.batch}",
               f"recipe.data.num_workers={args.workers}", f"graph={graph}", f"train.max_steps={args.steps}",
               f"run_dir={run_dir}"]
    r = train_results(SCRIPT, f"{model} {graph} from {source}", command, run_dir, args.timeout)
    return {"model": model, "graph": graph, "source": source, "images_per_s": r["perf/wall_samples_per_s"],
            "step_ms_median": r["perf/step_ms_median"], "steps_timed": r["perf/wall_steps"],
            "startup_s": r["time/startup_s"], "first_step_s": r["time/first_step_s"],
            "rank_peak_host_mib": r["perf/peak_host_mib"], "run_peak_host_mib": r["host/tree_peak_mib"],
            "input_wait_share": r["time/input_wait_s"] / r["train_loop_s"],
            "window_wait_share": r["perf/wall_input_wait_s"] / r["perf/wall_s"],
            "peak_cores_busy": r["host/tree_peak_cores"], "cores_busy": r["host/tree_cores"],
            "rank_cores_busy": r["host/launched_cores"]}


def train_images(root: Path) -> int:
    return sum(1 for f in (root / "train").rglob("*") if f.is_file())


def epoch_end_note(root: Path, batch: int, steps: int, drop_last: bool = False) -> Optional[str]:
    """Why a short folder's numbers are not the step's: each epoch's end falls inside this repo's runs, and with it a
    tail step (a partial batch; under full_compiled the first compiles a step of its own, tens of seconds), unless
    ``drop_last`` (``recipe.data.drop_last=true``) drops it."""
    images = train_images(root)
    per_epoch = images // batch if drop_last else math.ceil(images / batch)
    if per_epoch >= steps:
        return None
    tail = 0 if drop_last else images % batch
    return (f"note: an epoch of {root} is {per_epoch} steps of {batch}"
            + (f" (the last a tail of {tail} images)" if tail else "") + f", fewer than a run's {steps}: its "
            f"steps hold {(steps - 1) // per_epoch} epoch end(s)" + (" and their tail steps (under "
            "full_compiled the first compiles a step of its own: tens of seconds inside the window)" if tail else "")
            + f"; a folder of at least {steps * batch:,} images times the step alone")


def run_references(args: argparse.Namespace, model: str, work: Path, timed: int) -> Dict[str, Any]:
    """torchvision's references/classification/train.py on the same folder, model and batch: images/s over ``timed``
    optimizer steps after REFERENCE_UNTIMED (scripts/time_steps.py)."""
    output = work / f"references_{model}.json"
    command = [sys.executable, str(ROOT / "scripts" / "time_steps.py"), "--skip", str(REFERENCE_UNTIMED),
               "--steps", str(timed), "--batch", str(args.batch), "--output", str(output),
               str(args.references / "train.py"), "--data-path", str(args.root), "--model", model,
               "--batch-size", str(args.batch), "--amp", "--workers", str(args.workers), "--epochs", "1000",
               "--train-crop-size", str(args.image_size), "--val-crop-size", str(args.image_size),
               "--val-resize-size", str(round(args.image_size / 0.875)),
               "--output-dir", str(work / f"references_{model}"), *([] if cuda_device_count() else ["--device", "cpu"])]
    per_epoch = math.ceil(train_images(args.root) / args.batch)
    if per_epoch < REFERENCE_UNTIMED + timed:
        print(f"{SCRIPT}: note: an epoch of {args.root} is {per_epoch} steps of {args.batch}, fewer than the "
              f"references' {REFERENCE_UNTIMED} untimed and {timed} timed: their window holds an epoch's end (its "
              "evaluation, checkpoint and new loader workers); a larger folder compares steps alone", flush=True)
    usage = measured_run(SCRIPT, f"torchvision's references/classification/train.py ({model})", command, output,
                         args.timeout)
    window = json.loads(output.read_text())
    ended = output.stat().st_mtime  # time_steps.py writes it as its window closes
    cores, own = usage.cores_between(ended - window["wall_s"], ended)
    return {"model": model, "graph": "references (--amp)", "source": "folder", "images_per_s": window["samples_per_s"],
            "step_ms_mean": 1e3 * window["wall_s"] / window["steps"], "steps_timed": window["steps"],
            "run_peak_host_mib": usage.peak_mib, "cores_busy": cores, "rank_cores_busy": own}


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(prog=SCRIPT, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="an image folder (scripts/make_image_folder.py)")
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"], help="torchvision model names")
    parser.add_argument("--graphs", nargs="+", default=["full"], help="graph modes (full)")
    parser.add_argument("--image-size", type=int, default=224, help="pixels a side (224)")
    parser.add_argument("--batch", type=int, default=256, help="images a step (256)")
    parser.add_argument("--steps", type=int, default=150,
                        help="steps a run, the untimed first ones included (150: over 46 timed steps the same "
                             "folder-fed step read 0.83-0.85 of the GPU-fed one, over 136 0.92-0.96)")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs, folder then synthetic (2)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    parser.add_argument("--workers", type=int, default=max(1, cores - 1),
                        help=f"the loader's worker processes (every core but one: {max(1, cores - 1)})")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds one run may take (400)")
    parser.add_argument("--output", type=Path, default=ROOT / "scripts" / "results" / "images.json")
    parser.add_argument("--references", type=Path, default=None,
                        help="a folder holding torchvision's references/classification/train.py: run it too")
    args, cfg = script_config(parser, argv, defaults=DEFAULTS)  # composed once: a bad override is said before any run
    check_overrides(args.overrides, SETS, SCRIPT)
    if not (args.root / "train").is_dir():
        refuse(f"{SCRIPT}: --root {args.root} has no train/ folder: give an image folder (train/<class>/*.jpg and "
               "test/<class>/; scripts/make_image_folder.py writes one)")
    if args.references is not None and not ((args.references / "train.py").is_file() and (args.root / "val").is_dir()):
        refuse(f"{SCRIPT}: --references needs {args.references}/train.py (torchvision's references/classification) "
               f"and {args.root}/val/, the folder it evaluates on (make_image_folder.py --val writes one)")
    if args.steps < 30 or args.repeats < 1:
        parser.error("--steps must be at least 30 (the first are warm-up and capture) and --repeats at least 1")
    args.root = args.root.resolve()
    note = epoch_end_note(args.root, args.batch, args.steps, bool(cfg.recipe.data.get("drop_last", False)))
    if note:
        print(f"{SCRIPT}: {note}", flush=True)
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_images_") as work:
        for model in args.models:
            for graph in args.graphs:
                for _ in range(args.repeats):
                    for source in SOURCES:
                        rows.append(run_once(args, model, graph, source, Path(work), len(rows)))
                        print(f"{SCRIPT}: {model} {graph} {source}: {rows[-1]['images_per_s']:,.0f} images/s",
                              flush=True)
            if args.references is not None:
                ours = [r for r in rows if r["model"] == model and r["source"] == "folder"]
                rows.append(run_references(args, model, Path(work), int(statistics.median(
                    r["steps_timed"] for r in ours))))
                best = max(r["images_per_s"] for r in ours)
                rows[-1]["ours_over_references"] = best / rows[-1]["images_per_s"]
                print(f"{SCRIPT}: {model} torchvision references: {rows[-1]['images_per_s']:,.0f} images/s; this "
                      f"repo's best folder-fed run {rows[-1]['ours_over_references']:.2f}x", flush=True)
    ours = [r for r in rows if not r["graph"].startswith("references")]
    for folder, synthetic in zip(ours[::2], ours[1::2]):
        folder["folder_over_synthetic"] = folder["images_per_s"] / synthetic["images_per_s"]
    measured = provenance(gpu_name() if cuda_device_count() else "CPU")
    table = markdown_table(
        ["model", "graph", "source", "images/s (wall)", "step ms (median; references: mean)", "folder / synthetic",
         "this repo / it", "start-up s", "first step s", "host MiB (rank)", "host MiB (run, workers too)",
         "loop waiting for input", "of it in the timed steps", "cores busy (the rank alone), timed steps"],
        [[r["model"], r["graph"], r["source"], f"{r['images_per_s']:,.0f}",
          round(r.get("step_ms_median", r.get("step_ms_mean", 0.0)), 2),
          f"{r['folder_over_synthetic']:.3f}" if "folder_over_synthetic" in r else "",
          f"{r['ours_over_references']:.2f}x" if "ours_over_references" in r else "",
          *([round(r["startup_s"], 1), round(r["first_step_s"], 1), round(r["rank_peak_host_mib"])]
            if "startup_s" in r else [""] * 3),  # the references report no start-up and no rank of their own
          round(r["run_peak_host_mib"]), f"{r['input_wait_share']:.1%}" if "input_wait_share" in r else "",
          f"{r['window_wait_share']:.1%}" if "window_wait_share" in r else "",
          f"{r['cores_busy']:.1f} ({r['rank_cores_busy']:.1f})"]
         for r in rows])
    medians = {f"{m} {g}": statistics.median(r["folder_over_synthetic"] for r in ours
                                             if (r["model"], r["graph"]) == (m, g) and "folder_over_synthetic" in r)
               for m in args.models for g in args.graphs}
    command = " ".join(["python", f"scripts/{SCRIPT}", f"--root {args.root}", "--models", *args.models, "--graphs",
                        *args.graphs, f"--image-size {args.image_size}", f"--batch {args.batch}",
                        f"--steps {args.steps}", f"--repeats {args.repeats}", f"--workers {args.workers}",
                        *([f"--references {args.references}"] if args.references else []),
                        *args.train_options, *args.overrides])
    text = (f"{table}\n\nFolder over synthetic, median of the pairs: "
            + ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
            + f".\n\n`{command}`; {os.cpu_count()} CPU cores. {provenance_line(measured)}\n"
            + (f"\n{note[0].upper()}{note[1:]}.\n" if note else ""))
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, {"rows": rows, "median_folder_over_synthetic": medians, "command": command,
                             "provenance": measured, "cpu_cores": os.cpu_count(), "note": note})
    args.output.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
