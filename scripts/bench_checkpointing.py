"""What activation checkpointing costs in step time and buys in memory, on one GPU.

    python scripts/bench_checkpointing.py                     # gpt2_small, bf16, graph=full, synthetic data
    python scripts/bench_checkpointing.py recipe=cifar10_resnet18 --batch-size 128 --max-batch 0
    python scripts/bench_checkpointing.py --max-batch 512 --time-budget 900   # a wider search
    python scripts/bench_checkpointing.py --config-dir my_conf recipe=mine    # your own configs, as train.py

For train.activation_checkpointing=false and =true, on synthetic data: the median step time
over --steps replayed graph steps, the throughput and the peak allocated memory
(torch.cuda.max_memory_allocated, from start to end) at --batch-size; then the largest
micro-batch (recipe.data.batch_size) that fits, searched by doubling up to --max-batch and
then by bisection to --granularity (the search with checkpointing starts where the one
without stopped). Each trial is a fresh process, since an out-of-memory error can leave the
CUDA context and the caching allocator unusable; a trial that runs out of memory while it
builds, warms up, captures or steps does not fit. A trial of the search runs graph.warmup_iters
eager steps (3 here: one process has no DDP bookkeeping), the capture and 2 replays. The
search stops when --time-budget seconds would be passed, saying how far it got.

Prints a markdown table; writes the numbers and every trial as JSON to --output (default
scripts/results/checkpointing_<recipe>.json) and the table beside it (.md).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.lib.launch import run_captured  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402
from trainer.run.cli import script_config  # noqa: E402

DEFAULTS = ["recipe=gpt2_small", "graph=full", "logger=none", "train.progress=false", "train.eval=false",
            "recipe.data.source=synthetic", "graph.warmup_iters=3"]
SETTING = "train.activation_checkpointing"
TRIAL_LINE = "bench_checkpointing trial: "  # how a trial process reports back, on its stdout
OUT_OF_MEMORY = ("out of memory", "alloc_failed")  # torch's OutOfMemoryError; cuBLAS/cuDNN workspaces
SEARCH_REPLAYS = 1  # timed replays in a trial of the search (after one to settle): memory, not time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the micro-batch timed (default: the config's recipe.data.batch_size)")
    parser.add_argument("--steps", type=int, default=20, help="replayed steps timed at --batch-size")
    parser.add_argument("--max-batch", type=int, default=256,
                        help="the largest micro-batch the search tries (0: no search)")
    parser.add_argument("--granularity", type=int, default=8, help="the search stops when it brackets this closely")
    parser.add_argument("--time-budget", type=float, default=260.0,
                        help="seconds for the whole benchmark; the search stops before it would pass them")
    parser.add_argument("--trial-timeout", type=float, default=240.0, help="seconds one trial may take")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON file (default scripts/results/checkpointing_<recipe>.json); the table beside it")
    parser.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)  # one trial, in its own process
    args, cfg = script_config(parser, defaults=lambda a: [] if a.trial else DEFAULTS)
    if args.trial:
        return run_trial(cfg, args.steps)
    import torch  # after the command line: --help and a bad override answer at once

    if not torch.cuda.is_available():
        refuse("bench_checkpointing.py measures GPU memory and step time: run it on a machine with CUDA")
    if args.steps < 1 or args.granularity < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--steps, --granularity and --batch-size must be at least 1")
    started = time.monotonic()
    batch = args.batch_size or cfg.recipe.data.batch_size
    scratch = Path(tempfile.mkdtemp(prefix="bench_checkpointing_"))
    try:
        bench = Bench(args, scratch, started, warmup_iters=cfg.graph.warmup_iters)
        settings = {}
        for checkpointing in (False, True):
            timed = bench.trial(checkpointing, batch, args.steps)
            if timed is None:
                refuse(f"out of time before the timed trial with {SETTING}={str(checkpointing).lower()}: "
                       "raise --time-budget")
            settings[label(checkpointing)] = {"timed": timed}
        for checkpointing in (False, True):
            found = settings[label(checkpointing)]
            start = settings["off"]["search"]["largest_fitting"] if checkpointing and args.max_batch else None
            if args.max_batch:
                found["search"] = bench.search(checkpointing, batch, found["timed"]["fits"], start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "recipe": cfg.recipe.name,
        "overrides": [*DEFAULTS, *args.overrides], "batch_size": batch, "steps": args.steps,
        "max_batch": args.max_batch, "granularity": args.granularity, "settings": settings,
        "trials": bench.trials, "elapsed_s": round(time.monotonic() - started, 1),
    }
    table = markdown_table(result)
    print(table)
    output = args.output or REPO / "scripts" / "results" / f"checkpointing_{cfg.recipe.name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    output.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {output} and {output.with_suffix('.md').name} ({result['elapsed_s']:.0f} s)")
    return 0


def label(checkpointing: bool) -> str:
    return "on" if checkpointing else "off"


class Bench:
    """Runs trials, each in its own process, within the time budget, and keeps every one."""

    def __init__(self, args, scratch: Path, started: float, warmup_iters: int):
        self.args, self.scratch, self.started, self.warmup_iters = args, scratch, started, warmup_iters
        self.trials: List[Dict] = []
        self.longest_s = 0.0

    def trial(self, checkpointing: bool, batch: int, timed_steps: int = 0) -> Optional[Dict]:
        """One trial's outcome (``fits``, and when it fits step times and peak memory); None when
        it would not finish within the time budget (judged by the longest trial so far)."""
        left = self.args.time_budget - (time.monotonic() - self.started)
        if self.trials and self.longest_s > left:
            return None
        steps = timed_steps or SEARCH_REPLAYS
        needed = self.warmup_iters + 1 + 2 * steps + 4  # one epoch's steps: warm-up, capture, settling, timed, room
        overrides = [*DEFAULTS, *self.args.overrides, f"{SETTING}={str(checkpointing).lower()}",
                     f"recipe.data.batch_size={batch}", f"recipe.data.train_size={batch * needed}",
                     "recipe.data.test_size=16", "recipe.data.eval_batch_size=16",
                     "graph.on_failure=eager",  # a failed capture ends the trial without the doctor's extra step
                     f"output_root={self.scratch / str(len(self.trials))}"]
        command = [sys.executable, str(Path(__file__).resolve()), "--trial", "--steps", str(steps),
                   *self.args.train_options, *overrides]
        began = time.monotonic()
        stdout, stderr, code = run_captured(command, self.args.trial_timeout)  # code None: past its time
        seconds = time.monotonic() - began
        self.longest_s = max(self.longest_s, seconds)
        outcome = read_trial(stdout, stderr, code)
        outcome.update({SETTING: checkpointing, "batch_size": batch, "seconds": round(seconds, 1)})
        self.trials.append(outcome)
        peak = outcome.get("peak_allocated_mib")
        said = (("fits" + (f", peak {peak:,.0f} MiB allocated" if peak is not None else "")) if outcome["fits"]
                else f"does not fit (out of memory in {outcome.get('phase', 'the trial')})")
        print(f"{SETTING}={str(checkpointing).lower()} batch {batch}: {said} ({seconds:.0f} s)", flush=True)
        return outcome

    def search(self, checkpointing: bool, batch: int, batch_fits: bool, start: Optional[int]) -> Dict:
        """The largest micro-batch that fits: doubling up to --max-batch, then bisection."""
        def fits(size: int) -> Optional[bool]:
            outcome = self.trial(checkpointing, size)
            return None if outcome is None else outcome["fits"]

        fitting, failing, complete = largest_fitting(fits, batch, batch_fits, self.args.max_batch,
                                                     self.args.granularity, start)
        return {"largest_fitting": fitting, "smallest_failing": failing, "complete": complete,
                "reached_max_batch": failing is None and fitting == self.args.max_batch}


def largest_fitting(fits: Callable[[int], Optional[bool]], known: int, known_fits: bool, limit: int,
                    granularity: int, start: Optional[int] = None) -> Tuple[Optional[int], Optional[int], bool]:
    """(largest size seen to fit or None, smallest seen to fail or None, whether the search finished).

    ``known``: a size already tried (``known_fits``). ``fits(size)`` tries one size: True, False, or
    None when out of time (the search stops there, unfinished). Doubling from the largest fitting
    size (or from ``start`` first, a guess) up to ``limit``; halving below a failing ``known``; then
    bisection until the bracket is at most ``granularity`` wide.
    """
    fitting, failing = (known, None) if known_fits else (None, known)
    guess = start if start is not None and start > known and start <= limit else None

    def next_size() -> Optional[int]:
        if failing is None:  # up
            return (guess or min(2 * fitting, limit)) if fitting < limit else None
        if fitting is None:  # down
            return failing // 2 if failing > 1 else None
        if failing - fitting > granularity:  # between
            middle = (fitting + failing) // 2
            return middle - middle % granularity if middle - middle % granularity > fitting else middle
        return None

    while (size := next_size()) is not None:
        guess = None
        verdict = fits(size)
        if verdict is None:
            return fitting, failing, False
        fitting, failing = (size, failing) if verdict else (fitting, size)
    return fitting, failing, True


def read_trial(stdout: str, stderr: str, code: Optional[int]) -> Dict:
    """A trial's report line; without one, an out-of-memory crash does not fit and anything else stops the bench."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(TRIAL_LINE):
            return json.loads(line[len(TRIAL_LINE):])
    if any(mark in (stdout + stderr).lower() for mark in OUT_OF_MEMORY):
        return {"fits": False, "phase": "a crash", "exit_code": code}
    how = "timed out" if code is None else f"exited {code}"
    sys.exit(f"a trial {how} without a result:\n{stderr[-3000:] or stdout[-3000:]}")  # 1: a failure, not a refusal


# ---- one trial, in its own process --------------------------------------------------------

def run_trial(cfg, steps: int) -> int:
    from trainer.session import Session

    return Session(cfg, purpose="bench_checkpointing").execute(lambda session: trial_job(session, steps))


def trial_job(session, steps: int) -> int:
    """Builds the run as train.py does, warms up and captures, then times ``steps`` steps (train.py's
    timer: scripts/lib/timing.py); prints one report line, also when memory ran out (which does not fit)."""
    import torch

    from scripts.lib.timing import time_steps

    phase = "build"
    try:
        trainer = session.build()
        ex = trainer.executor
        phase = "warm-up and capture"
        trainer.warm_up()
        if ex.report.fallback is not None:  # the capture failed: the trial ends here, whatever the reason
            phase = "capture"
            raise RuntimeError(ex.report.fallback)
        phase = "steps"
        for _ in range(min(steps, 3)):  # settle
            trainer.next_step()
        timed = time_steps(trainer, steps)
    except Exception as error:
        if not out_of_memory(error):
            raise
        lines = str(error).strip().splitlines() or [type(error).__name__]
        said = next((line for line in lines if any(m in line.lower() for m in OUT_OF_MEMORY)), lines[0])
        report = {"fits": False, "phase": phase, "error": said.strip()[:300]}
    else:
        median, cuda = timed["step_ms_median"], trainer.rt.device.type == "cuda"
        report = {
            "fits": True, "mode": ex.report.mode, "phase_timed": trainer.phase(),
            "precision": trainer.plan.precision, "step_ms_median": median,
            "step_ms_p90": timed["step_ms_p90"],
            f"{trainer.recipe.unit}_per_s": trainer.global_batch * trainer.recipe.units_per_sample * 1e3 / median,
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
            "graph_pool_mib": ex.report.graph_pool_mib, "units_per_sample": trainer.recipe.units_per_sample,
            "unit": trainer.recipe.unit, "activation_checkpointing_used": trainer.recipe.activation_checkpointing,
        }
    print(TRIAL_LINE + json.dumps(report), flush=True)
    return 0


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error``, or one it was raised from (a failed capture's CaptureError), is a lack of device memory."""
    import torch

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError) or any(m in str(error).lower() for m in OUT_OF_MEMORY):
            return True
        error = error.__cause__ or error.__context__
    return False


# ---- the table ------------------------------------------------------------------------

def markdown_table(result: Dict) -> str:
    settings, batch = result["settings"], result["batch_size"]
    timed = {name: s["timed"] for name, s in settings.items()}
    unit = next((t["unit"] for t in timed.values() if t["fits"]), "samples")
    lines = [f"{result['recipe']} on {result['device']} (torch {result['torch']}), "
             f"{next((t['mode'] for t in timed.values() if t['fits']), '?')} mode, "
             f"{next((t['precision'] for t in timed.values() if t['fits']), '?')}, synthetic data",
             "",
             f"| {SETTING} | step ms (median, batch {batch}) | p90 | {unit}/s | peak allocated MiB | "
             f"largest micro-batch that fits |",
             "|---|---|---|---|---|---|"]
    for name, s in settings.items():
        t = s["timed"]
        cells = ([f"{t['step_ms_median']:.2f}", f"{t['step_ms_p90']:.2f}", f"{t[f'{unit}_per_s']:,.0f}",
                  f"{t['peak_allocated_mib']:,.0f}"] if t["fits"] else ["does not fit"] + ["—"] * 3)
        lines.append(f"| {name} | {' | '.join(cells)} | {largest_cell(s.get('search'), result['max_batch'])} |")
    off, on = timed.get("off", {}), timed.get("on", {})
    if off.get("fits") and on.get("fits"):
        lines += ["", f"with checkpointing: step time {on['step_ms_median'] / off['step_ms_median']:.2f}x, "
                      f"peak memory {on['peak_allocated_mib'] / off['peak_allocated_mib']:.2f}x at batch {batch}"]
        bigger = [settings[n].get("search", {}).get("largest_fitting") for n in ("off", "on")]
        if all(bigger):
            lines[-1] += f"; largest micro-batch {bigger[1] / bigger[0]:.2f}x"
    return "\n".join(lines)


def largest_cell(search: Optional[Dict], limit: int) -> str:
    if not search:
        return "not searched"
    fitting, failing = search["largest_fitting"], search["smallest_failing"]
    if fitting is None:
        return f"none (from {failing} down)"
    if search["reached_max_batch"]:
        return f"{fitting} or more (--max-batch {limit})"
    said = f"{fitting} ({failing} does not)" if failing is not None else f"{fitting} or more"
    return said if search["complete"] else f"{said}, search stopped by --time-budget"


if __name__ == "__main__":
    sys.exit(main())
