"""Times any PyTorch training script by its optimizer steps, the script left as it is: a yardstick's wall window.

    python scripts/time_steps.py --skip 20 --steps 50 --batch 256 --output ref.json \\
        vision/references/classification/train.py --data-path /data/photos --model resnet50 -b 256 --amp -j 15

The script runs in this process (``runpy``, its own folder first on the import path, ``sys.argv`` as given) with
one thing added: a global optimizer step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``).
After ``--skip`` optimizer steps it synchronizes the GPU and starts a wall clock; after ``--steps`` more it
synchronizes again, writes ``--output`` (steps, seconds, and samples/s from ``--batch``) and ends the script
(SystemExit 0): the window holds every wait of those steps, data loading included, as this repo's own wall window
does (trainer/metrics/perf.py). A script that ends before the window closes writes nothing and exits 1.
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

SCRIPT = "time_steps.py"


class StepWindow:
    """The optimizer step hook: counts steps, and times ``steps`` of them after ``skip``."""

    def __init__(self, skip: int, steps: int, batch: int, output: Path):
        self.skip, self.steps, self.batch, self.output = skip, steps, batch, output
        self.count, self.began = 0, None

    def __call__(self, optimizer, args, kwargs) -> None:
        self.count += 1
        if self.count == self.skip:
            self.began = _synchronized_clock()
        elif self.count == self.skip + self.steps:
            wall = _synchronized_clock() - self.began
            result = {"steps": self.steps, "skipped": self.skip, "wall_s": wall, "batch": self.batch,
                      "samples_per_s": self.steps * self.batch / wall}
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self.output.write_text(json.dumps(result, indent=1) + "\n")
            print(f"{SCRIPT}: {self.steps} steps after {self.skip} in {wall:.3f} s: "
                  f"{result['samples_per_s']:,.1f} samples/s -> {self.output}", flush=True)
            raise SystemExit(0)


def _synchronized_clock() -> float:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=SCRIPT, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", type=int, default=20, help="optimizer steps before the window (20)")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps in the window (50)")
    parser.add_argument("--batch", type=int, required=True, help="samples a step (the script's global batch)")
    parser.add_argument("--output", type=Path, required=True, help="the JSON the window is written to")
    parser.add_argument("script", type=Path, help="the training script, then its own arguments (after --)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.skip < 1 or args.steps < 1:
        parser.error("--skip and --steps must be at least 1")
    if not args.script.is_file():
        parser.error(f"{args.script} is not a file")
    script = args.script.resolve()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(StepWindow(args.skip, args.steps, args.batch, args.output.resolve()))
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.parent))  # a script's own modules beside it (the references' presets, utils)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as ended:
        if ended.code not in (0, None) or not args.output.is_file():
            print(f"{SCRIPT}: {script.name} ended (exit {ended.code}) before its window of {args.steps} steps "
                  f"after {args.skip} closed", file=sys.stderr)
            return 1
        return 0
    print(f"{SCRIPT}: {script.name} returned before its window of {args.steps} steps after {args.skip} closed",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
