"""Where the time of one training step goes, on one GPU.

    python scripts/profile_step.py graph=full                # any train.py overrides
    python scripts/profile_step.py graph=eager --steps 100

Builds the trainer as train.py does, warms up (and captures, in graph modes), then
profiles ``--steps`` steps: the step's wall time from CUDA events, the summed time of
the kernels and copies it ran (CUPTI), their ratio (how busy the GPU was), and the
kernel count per step. Prints a line and writes JSON to --output.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from conf.schema import compose  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.runtime import pick_device, seed_everything, start  # noqa: E402
from trainer.validate import check_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output", type=Path, default=None, help="JSON file for the numbers")
    args, overrides = parser.parse_known_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step.py measures GPU kernels: run it on a machine with CUDA")
    cfg = compose(["logger=none", "train.progress=false", *overrides])
    check_config(cfg)
    rt = start(pick_device(cfg.device.value), "/tmp/profile_step", None, "profile")
    seed_everything(cfg.seed, cfg.deterministic)
    trainer = Trainer(cfg, rt)
    ex, loader, step = trainer.executor, trainer.train_loader, trainer.train_step
    loader.start_epoch(0)
    needed = args.steps * 2 + cfg.graph.warmup_iters + 1
    if loader.steps < needed:
        sys.exit(f"need {needed} steps in one epoch, the data gives {loader.steps}: lower --steps")
    while ex.phase("train") in ("warmup", "capture"):
        ex.run("train", loader.stage, step)
    for _ in range(args.steps):  # settle
        ex.run("train", loader.stage, step)
    torch.cuda.synchronize()

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        ex.run("train", loader.stage, step)
    end.record()
    end.synchronize()
    wall_ms = begin.elapsed_time(end) / args.steps

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            ex.run("train", loader.stage, step)
        torch.cuda.synchronize()
    gpu_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in gpu_events) / 1e3 / args.steps
    result = {
        "device": torch.cuda.get_device_name(), "mode": ex.info["mode"] + ("+compile_model" if cfg.graph.compile_model else ""), "recipe": cfg.recipe.name,
        "batch_size": cfg.recipe.data.batch_size, "step_ms": wall_ms, "gpu_busy_ms": busy_ms,
        "gpu_busy_fraction": busy_ms / wall_ms, "gpu_ops_per_step": len(gpu_events) / args.steps,
    }
    print(json.dumps(result))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    trainer.close()
    rt.close()


if __name__ == "__main__":
    main()
