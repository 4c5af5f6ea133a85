"""Starting train.py from a script: one run per graph mode with everything else held fixed
(compare.py, sweep.py), or one benchmark run that must succeed (bench_*.py). Kept apart from
any command line so that every script launches runs the same way.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from scripts.lib.comparison import comparison_rows
from scripts.lib.refuse import refuse

ROOT = Path(__file__).resolve().parents[2]  # the checkout: train.py, conf/
CPU_MODES = ("eager", "auto")  # every other mode needs a CUDA GPU
NOT_AVAILABLE = "not available (no CUDA)"
# Overrides run_modes sets for each run (``command``); a user value would silently break the comparison.
RESERVED = ("graph", "graph.mode", "graph.compile_model", "output_root", "run_dir",
            "logger.wandb.group", "logger.wandb.job_type", "logger.wandb.name")


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
    """Refuses (exit 2) an override that the script sets itself, naming it."""
    for override in overrides:
        if override_key(override) in reserved:
            refuse(f"{script}: {override!r} is set by this script for every run: drop it "
                   f"and use the script's options instead (see {script} --help)")


def train_launcher(nproc: int, torchrun: bool = False) -> List[str]:
    """How train.py starts: torchrun for nproc > 1 (or when asked: DDP with one rank), plain python otherwise."""
    if nproc > 1 or torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    return [sys.executable, "train.py"]


def run_captured(command: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None
                 ) -> Tuple[str, str, Optional[int]]:
    """Runs ``command`` in the repo: (stdout, stderr, exit code), the code None when it ran past ``timeout``
    s (what it printed until then is kept: a report may be out before a teardown that hung)."""
    try:
        done = subprocess.run(list(command), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        return _text(e.stdout), _text(e.stderr), None
    return done.stdout, done.stderr, done.returncode


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def run_or_exit(script: str, name: str, command: Sequence[str], timeout: float,
                env: Optional[Dict[str, str]] = None) -> float:
    """A benchmark's one run: says the command, runs it in the repo, exits naming the run and the
    end of its stderr if it fails or runs past ``timeout`` s; returns its wall time in seconds."""
    print(f"{script}: {name}: {' '.join(command[1:])}", flush=True)
    started = time.time()
    _, stderr, code = run_captured(command, timeout, env)
    if code != 0:
        why = f"ran past {timeout:.0f} s" if code is None else f"failed ({code})"
        sys.exit(f"{script}: '{name}' {why}:\n{stderr[-3000:]}")  # 1: a failed run, not a refusal
    return time.time() - started


def command(mode: str, nproc: int, train_args: Sequence[str], output_root: Path, group: str,
            run_name: str) -> List[str]:
    """The train.py command line of one run (``train_launcher``).

    ``train_args``: train.py's ``--config-dir``/``--config-name`` (first), then the overrides.
    """
    return [*train_launcher(nproc), *train_args, f"graph={mode}", f"output_root={hydra_value(str(output_root))}",
            f"logger.wandb.group={hydra_value(group)}", f"logger.wandb.job_type={mode}",
            f"logger.wandb.name={hydra_value(f'{run_name}-{mode}')}"]


def failure_line(stderr: str) -> str:
    """The line that says why a run failed: the first error its processes printed (the rank that failed first;
    others then fail on the broken connection), not torchrun's own report; else its last line. A line longer
    than a table cell keeps its first 300 characters."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not set(line.strip()) <= set("=-")]
    own = [line for line in lines if "ChildFailedError" not in line and "torch.distributed.elastic" not in line]
    named = [line for line in own if "ran past" in line or re.search(r"\w*(Error|Exception)\b:|\berror:", line)]
    line = (named[:1] or lines[-1:] or ["(no output)"])[0]
    return line if len(line) <= 300 else line[:299] + "…"  # its start: the error's name, then what it says


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
        outcome["status"] = f"failed (exit {outcome['exit_code']}): {failure_line((root / 'stderr.log').read_text(errors='replace'))}"
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


# ---- shared by the scripts' command lines ---------------------------------------------

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
