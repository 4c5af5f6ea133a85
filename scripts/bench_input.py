"""Input throughput: a PNG folder through the host loader next to the device loader.

    python scripts/bench_input.py --folder /tmp/cifar_png                      # CIFAR-10 ResNet-18, bf16, graphed
    python scripts/bench_input.py --folder /tmp/cifar_png --workers 4,8,14 --steps 300 --output bench.json
    python scripts/bench_input.py --folder DIR recipe=mnist train.precision=fp32   # any train.py overrides
    python scripts/bench_input.py --folder DIR --config-dir my_conf recipe=mine     # your own configs, as train.py

Makes the folder first when it is missing (scripts/export_images.py, synthetic CIFAR-10
unless overrides say otherwise). Then, in one process on one GPU, for the same images,
precision and memory format: the device loader (the folder decoded once into GPU memory)
and the host loader with each worker count (PNGs decoded by DataLoader workers every
step). Each is warmed up and captured, then ``--steps`` graphed steps are timed as train.py
times its steps (graphing.StepTimer's CUDA events, back to back): step_ms is their mean, the
wall time per step, so a step that waits for its batch counts.

For the host loader it also reports where the host's time goes: the share of the
step the loop spent waiting for its workers' next batch (near 0: the GPU bounds the
step), and per batch the cost of decoding (one process), of collating, and of the copy
into pinned memory.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from conf.schema import compose  # noqa: E402
from scripts.lib.launch import run_or_exit  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402
from scripts.lib.timing import time_steps  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402
from trainer.session import Session  # noqa: E402

EXPORT_TIMEOUT_S = 3600  # writing a dataset to disk as PNG files
DEFAULTS = ["recipe=cifar10_resnet18", "graph=full", "train.precision=bf16", "logger=none",
            "train.progress=false", "train.eval=false"]


def timed_steps(trainer, steps: int):
    """(seconds per step, seconds per step the host loader waited for its workers) over ``steps`` graphed steps.

    Timed by train.py's timer (scripts/lib/timing.py): the mean of back-to-back intervals is the wall time
    per step, a wait for a batch included."""
    ex, loader = trainer.executor, trainer.train_loader
    if loader.shapes.full_steps < steps + 2 * ex.warmup_iters:
        refuse(f"the folder gives {loader.shapes.full_steps} steps per epoch: lower --steps to at most "
               f"{loader.shapes.full_steps - 2 * ex.warmup_iters}")
    trainer.warm_up()
    for _ in range(ex.warmup_iters):  # settle (the workers' queues fill)
        trainer.next_step()
    waited = getattr(loader, "waited_s", 0.0)
    step_ms = time_steps(trainer, steps)["step_ms_mean"]
    return step_ms / 1e3, (getattr(loader, "waited_s", 0.0) - waited) / steps


def host_costs(trainer, batches: int = 20):
    """Per batch, in one process: decode (dataset items), collate (stack), copy into pinned memory.
    Host work, not a GPU step: the host clock times it."""
    import torch

    from trainer.data import collate, host_copy

    dataset, loader = trainer.recipe.data.train, trainer.train_loader
    n = loader.rows_per_load
    began = time.perf_counter()
    items = [[dataset[(b * n + i) % len(dataset)] for i in range(n)] for b in range(batches)]
    decode = (time.perf_counter() - began) / batches
    began = time.perf_counter()
    stacked = [collate(batch) for batch in items]
    collate_s = (time.perf_counter() - began) / batches
    pinned = torch.empty_like(stacked[0]["x"], pin_memory=True)
    began = time.perf_counter()
    for fields in stacked:
        host_copy(pinned, fields["x"])  # as the loader copies
    copy = (time.perf_counter() - began) / batches
    return {"decode_ms_per_batch": 1e3 * decode, "collate_ms_per_batch": 1e3 * collate_s,
            "pinned_copy_ms_per_batch": 1e3 * copy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True, help="an image folder (made when missing)")
    parser.add_argument("--workers", default="4,8,14", help="host-loader worker counts to try")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--output", type=Path, default=None, help="JSON file for the numbers")
    args, _ = script_config(parser, defaults=DEFAULTS)  # the overrides compose: each loader's config is built below
    overrides = args.overrides
    import torch  # after the command line: --help and a bad override answer at once

    if not torch.cuda.is_available():
        refuse("bench_input.py measures a graphed GPU step: run it on a machine with CUDA")
    if not (args.folder / "train").is_dir():
        recipe = next((o for o in [*DEFAULTS, *overrides][::-1] if o.startswith("recipe=")), DEFAULTS[0])
        source = next((o for o in overrides if o.startswith("recipe.data.source=")), "recipe.data.source=synthetic")
        print(f"exporting {recipe} ({source}) to {args.folder} ...", flush=True)
        run_or_exit("bench_input", "export", [sys.executable, str(REPO / "scripts" / "export_images.py"),
                                              *args.train_options, recipe, source, "--output", str(args.folder)],
                    timeout=EXPORT_TIMEOUT_S)
    rows, used = [], {}

    def measure(session, loader: str, workers: int) -> int:  # one row: its own session, closed before the next
        trainer = session.build()
        step_s, waited_s = timed_steps(trainer, args.steps)
        samples = session.cfg.recipe.data.batch_size * session.cfg.train.grad_accum
        row = {"loader": loader, "num_workers": workers if loader == "host" else None,
               "samples_per_s": samples / step_s, "step_ms": 1e3 * step_s,
               "batch_wait_share": waited_s / step_s if loader == "host" else None}
        if loader == "host":
            row.update(host_costs(trainer))
        rows.append(row)
        used["precision"] = trainer.plan.precision  # as resolved (train.precision=auto)
        print(json.dumps(row), flush=True)
        return 0

    for loader, workers in [("device", 8)] + [("host", int(w)) for w in args.workers.split(",")]:
        cfg = compose([*DEFAULTS, *overrides, "recipe.data.source=folder", f"recipe.data.root={args.folder}",
                       f"recipe.data.loader={loader}", f"recipe.data.num_workers={workers}", "device=cuda"],
                      config_dir=args.config_dir, config_name=args.config_name)
        code = Session(cfg, purpose="bench_input").execute(lambda session: measure(session, loader, workers))
        if code:
            return code
        torch.cuda.empty_cache()
    precision = used["precision"]
    device_rate = rows[0]["samples_per_s"]
    best = max(rows[1:], key=lambda r: r["samples_per_s"])
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cpus": len(__import__("os").sched_getaffinity(0)),
        "recipe": cfg.recipe.name, "precision": precision, "mode": cfg.graph.mode.value,
        "batch_size": cfg.recipe.data.batch_size, "steps": args.steps, "folder": str(args.folder), "rows": rows,
        "best_host": best, "host_vs_device": best["samples_per_s"] / device_rate,
    }
    print(f"device loader {device_rate:,.0f} samples/s; best host loader {best['samples_per_s']:,.0f} samples/s "
          f"with {best['num_workers']} workers = {result['host_vs_device']:.1%} of the device loader")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
