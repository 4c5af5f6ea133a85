"""Starting train.py from a script: one run per graph mode with everything else held fixed
(compare.py, sweep.py), or one benchmark run that must succeed (bench_*.py). Kept apart from
any command line so that every script launches runs the same way.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from scripts.lib import process_tree
from scripts.lib.comparison import comparison_rows
from scripts.lib.refuse import refuse

ROOT = Path(__file__).resolve().parents[2]  # the checkout: train.py, conf/
CPU_MODES = ("eager", "auto")  # every other mode needs a CUDA GPU
NOT_AVAILABLE = "not available (no CUDA)"
STOP_GRACE_S = 10.0  # a stopped run's processes have this long after a SIGTERM, then are killed
# Overrides run_modes sets for each run (``command``); a user value would silently break the comparison.
RESERVED = ("graph", "graph.mode", "graph.compile_model", "output_root", "run_dir",
            "logger.wandb.group", "logger.wandb.job_type", "logger.wandb.name")


def cuda_device_count() -> int:
    import torch  # here, so `--help` stays fast
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def hydra_value(value: Any) -> str:
    """``value`` as a Hydra override's value: a string quoted unless it is plainly safe; a mapping, list, number,
    bool or None in Hydra's grammar (``{a:1,b:[true,null]}``)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{hydra_value(str(k))}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)  # 1e-05, 500000.0: Hydra reads both as floats
    # A plain word stays bare unless Hydra would read it as another type (true, null, 123, 1e-5, nan)
    if re.fullmatch(r"[A-Za-z_/][\w./-]*", value) and value.lower() not in ("true", "false", "null", "nan", "inf"):
        return value
    # Quoted, Hydra unescapes only backslashes before a quote or the closing quote
    return "'" + re.sub(r"(\\+)(?='|$)", r"\1\1", value).replace("'", "\\'") + "'"


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


def run_captured(command: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None, *,
                 name: Optional[str] = None) -> Tuple[str, str, Optional[int]]:
    """Runs ``command`` in the repo: (stdout, stderr, exit code), the code None when it ran past ``timeout``
    s (what it printed until it was stopped is kept: a report may be out before a teardown that hung).
    ``name``: what the line that says it was stopped calls it (default: its command)."""
    stdout, stderr, code = _run(command, timeout, env, name, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    return _text(stdout), _text(stderr), code


def _run(command: Sequence[str], timeout: float, env: Optional[Dict[str, str]], name: Optional[str],
         **streams) -> Tuple[Any, Any, Optional[int]]:
    """Every launcher's one way to run a command in the repo: ``Popen.communicate``'s (stdout, stderr) (None
    for a stream not piped) and the exit code, None past ``timeout`` s. The command runs in a session of its
    own, its processes marked (scripts/lib/process_tree.py); whatever ends the wait early (the timeout,
    Ctrl-C, a SIGTERM of this script: ``_sigterm_raises``) first ends every one of them, ranks included, and
    says so on stderr. ``streams``: Popen's stdout, stderr, text."""
    full_env, mark = process_tree.marked({**os.environ, **(env or {})})
    with _sigterm_raises():
        proc = subprocess.Popen(list(command), cwd=ROOT, env=full_env, start_new_session=True, **streams)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            return stdout, stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            _stop(proc, mark, command, name, f"timeout after {timeout:g} s")
            try:
                stdout, stderr = proc.communicate(timeout=5)  # all it printed, to its end
            except subprocess.TimeoutExpired:  # a pipe held open by a process that is not the run's
                stdout, stderr = e.output, e.stderr
            return stdout, stderr, None
        except BaseException as e:
            terminated = isinstance(e, SystemExit) and e.code == 128 + signal.SIGTERM
            _stop(proc, mark, command, name, "interrupted" if isinstance(e, KeyboardInterrupt)
                 else "terminated" if terminated else f"stopped by {type(e).__name__}")
            raise


def _stop(proc: subprocess.Popen, mark: str, command: Sequence[str], name: Optional[str], why: str) -> None:
    """Ends the run's processes (``process_tree.end``), then says which run, why and how many."""
    count = process_tree.end(proc, mark, STOP_GRACE_S)
    what = repr(name) if name else shlex.join(command)[:200]
    print(f"{Path(sys.argv[0]).stem}: stopped {what} ({why}): ended {count} process{'' if count == 1 else 'es'}",
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While a run is in flight, SIGTERM raises SystemExit (as after ``exit_on_sigterm``) where it would kill
    this script at once and orphan the run. A handler the script set itself stays; outside the main thread,
    where none can be set, nothing changes."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def run_or_exit(script: str, name: str, command: Sequence[str], timeout: float,
                env: Optional[Dict[str, str]] = None, log: Optional[Path] = None) -> float:
    """A benchmark's one run: says the command, runs it in the repo, exits naming the run and the
    end of its stderr if it fails or runs past ``timeout`` s; returns its wall time in seconds.
    ``log``: where its whole output (stdout, then stderr) is kept, for a script that reads a line of it."""
    wall, why, stderr = _bench_run(script, name, command, timeout, env, log)
    if why is not None:
        kept = f" (its output: {log})" if log is not None else ""
        sys.exit(f"{script}: '{name}' {why}{kept}:\n{stderr[-3000:]}")  # 1: a failed run, not a refusal
    return wall


def run_or_mark(script: str, name: str, command: Sequence[str], timeout: float,
                env: Optional[Dict[str, str]] = None, log: Optional[Path] = None) -> Tuple[float, str]:
    """A benchmark's run whose failure ends that run alone (the table keeps the others): as ``run_or_exit``,
    but returns (wall time in seconds, status): "ok", or why it stopped and its first error (``failure_line``)
    for its row; the end of a failed run's stderr is said on stderr. The script exits 1 at its end
    (scripts/lib/comparison.py ``exit_status``)."""
    wall, why, stderr = _bench_run(script, name, command, timeout, env, log)
    if why is None:
        return wall, "ok"
    print(f"{script}: '{name}' {why}; the table marks it and keeps the other runs:\n{stderr[-3000:]}",
          file=sys.stderr, flush=True)
    detail = failure_line(stderr, last_line=not why.startswith("ran past"))
    return wall, f"{why}: {detail}" if detail else why


def _bench_run(script: str, name: str, command: Sequence[str], timeout: float, env: Optional[Dict[str, str]],
               log: Optional[Path]) -> Tuple[float, Optional[str], str]:
    """Says the command, runs it (``run_captured``): (wall s, why it failed or None, its stderr)."""
    print(f"{script}: {name}: {' '.join(command[1:])}", flush=True)
    started = time.time()
    stdout, stderr, code = run_captured(command, timeout, env, name=name)
    if log is not None:
        log.write_text(stdout + stderr)
    why = None if code == 0 else f"ran past {timeout:.0f} s" if code is None else f"failed ({code})"
    return time.time() - started, why, stderr


def command(mode: str, nproc: int, train_args: Sequence[str], output_root: Path, group: str,
            run_name: str) -> List[str]:
    """The train.py command line of one run (``train_launcher``).

    ``train_args``: train.py's ``--config-dir``/``--config-name`` (first), then the overrides.
    """
    return [*train_launcher(nproc), *train_args, f"graph={mode}", f"output_root={hydra_value(str(output_root))}",
            f"logger.wandb.group={hydra_value(group)}", f"logger.wandb.job_type={mode}",
            f"logger.wandb.name={hydra_value(f'{run_name}-{mode}')}"]


def failure_line(stderr: str, last_line: bool = True) -> str:
    """The line that says why a run failed: the first error its processes printed (the rank that failed first;
    others then fail on the broken connection), not torchrun's own report; else its last line ("" when not
    ``last_line``: a run stopped at a timeout printed its last line for no reason of its own, a warning as often
    as not). A line longer than a table cell keeps its first 300 characters."""
    line = named_error_line(stderr)
    if line is None:
        lines = _lines(stderr)
        line = (lines[-1] if lines else "(no output)") if last_line else ""
    return line if len(line) <= 300 else line[:299] + "…"  # its start: the error's name, then what it says


def named_error_line(stderr: str) -> Optional[str]:
    """The first line of ``stderr`` that names an error (or says a worker ran past its time), torchrun's own
    report left out; None if there is none."""
    own = [line for line in _lines(stderr)
           if "ChildFailedError" not in line and "torch.distributed.elastic" not in line]
    named = [line for line in own if "ran past" in line or re.search(r"\w*(Error|Exception)\b:|\berror:", line)]
    return named[0] if named else None


def _lines(stderr: str) -> List[str]:
    return [line.strip() for line in stderr.splitlines() if line.strip() and not set(line.strip()) <= set("=-")]


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
    start = time.perf_counter()
    with open(root / "stdout.log", "w") as out, open(root / "stderr.log", "w") as err:
        outcome["exit_code"] = _run(cmd, timeout, {"PYTHONUNBUFFERED": "1"}, mode, stdout=out, stderr=err)[2]
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
    """SIGTERM raises SystemExit for the whole script, between runs too (``_sigterm_raises`` covers a run)."""
    signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, frame) -> None:
    sys.exit(128 + signum)


def timestamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def gpu_name() -> str:
    """torch's name of GPU 0 ("cpu" without one), asked in a child: this process holds no CUDA context beside the
    runs it starts."""
    code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    stdout, _, status = run_captured([sys.executable, "-c", code], 300)
    return stdout.strip().splitlines()[-1] if status == 0 and stdout.strip() else "unknown"
