"""Launching a script the way a user does (python or torchrun) and finding its outputs.

``Launch`` is the tests' one way to start a process: ``python train.py`` (or any script), or torchrun
with ``nproc`` gloo/NCCL ranks; ``start`` begins one, ``launch`` runs one to its end, ``launch_together``
runs several side by side. Every launch has a hard time limit: a hung rank fails its test, with the
stacks of the hung processes, and never hangs the suite. Every process a launch starts carries its marker and
the session's (helpers/processes.py; conftest kills any left when the session ends).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

from helpers import warm as warm_forks
from helpers.fault_injection import FAULT_ENVS, KILL_AT_STEP_ENV
from helpers.paths import ROOT
from helpers.processes import SESSION, cmdline, launch_marked, marked_pids, stacks
from scripts.lib.process_tree import kill

LAUNCH_TIMEOUT_S = 240.0  # one launch, at most, unless a test says otherwise
LOGS = Path(tempfile.gettempdir()) / f"graphed_ddp_test_launches_{SESSION}"  # launches that name no folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *, rdzv_endpoint: Optional[str] = None, rdzv_id: str = "test", max_restarts: int = 0,
             extra: Optional[List[str]] = None) -> List[str]:
    """The torchrun command line (without the script): one node of ``nproc`` ranks, a c10d rendezvous whose store
    the agent opens on a port the system picks (port 0, as ``--standalone`` does) unless ``rdzv_endpoint`` names
    one (several agents, one job), ``extra`` torchrun flags after these. A port picked here and handed over
    could be taken by a launch beside this one before its agent binds it (seen on a GPU machine running four
    test files at once: the agent then waited 60 s on the other job's store and failed)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint or '127.0.0.1:0'}", f"--rdzv-id={rdzv_id}",
            f"--max-restarts={max_restarts}", *(extra or [])]


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str  # empty where the launch merged it into stdout
    output_root: Optional[Path] = None
    ended: float = 0.0  # time.monotonic() when the launched process exited
    left: List[str] = field(default_factory=list)  # its processes still alive 10 s after it ended (then killed)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def run_dirs(self) -> List[Path]:
        return sorted(p.parent for p in self.output_root.rglob("config.yaml"))

    @property
    def run_dir(self) -> Path:
        dirs = self.run_dirs
        assert len(dirs) == 1, f"expected one run directory, found {dirs}\n{self.stderr[-3000:]}"
        return dirs[0]

    def results(self) -> Dict:
        return json.loads((self.run_dir / "results.json").read_text())

    def metrics(self) -> List[Dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


class Launch:
    """``python script args`` (nproc None) or ``torchrun --nproc_per_node=nproc script args``, in the background.

    ``faults`` (tests/helpers/fault_injection.py's variables) or ``kill_at_step`` ("STEP" or "STEP:RANK": that rank, 1 by
    default, is killed right after that step on the job's first attempt) run train.py through
    tests/helpers/fault_injection.py. ``torchrun_args``: ``torchrun()``'s keywords (rdzv_endpoint, rdzv_id, max_restarts,
    extra). Output goes to files in ``log_dir`` (a pipe that a rank inherits can keep its reader waiting), stderr
    into stdout's file with ``merge_output``. The launch runs in a session of its own, like a terminal's job: a
    signal to its group (``os.killpg(launch.proc.pid, ...)``) reaches torchrun and every rank. Without CUDA its
    Python processes are forks of a warm interpreter (helpers/warm.py) unless ``warm`` is False: a test about
    signals, workers or process lifetime passes False, so that it runs plain interpreters as torchrun and users do
    (``self.warm``: whether it went through the warm client, which still starts a plain python where a fork could
    not be one).
    """

    def __init__(self, args: List[str], log_dir: Path, *, script: str = "train.py", nproc: Optional[int] = None,
                 torchrun_args: Optional[Dict] = None, env: Optional[Dict[str, str]] = None,
                 faults: Optional[Dict[str, str]] = None, kill_at_step: Optional[str] = None,
                 merge_output: bool = False, cwd: Path = ROOT, name: str = "launch", warm: bool = True):
        faults = dict(faults or {})
        if kill_at_step is not None:
            faults[KILL_AT_STEP_ENV] = kill_at_step
        if faults:
            assert script == "train.py", "faults are injected into train.py only"
            script = "tests/helpers/fault_injection.py"
        full_env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE" and k not in FAULT_ENVS}  # W&B offline
        full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **faults,
                         **(env or {})})
        full_env, self.marker = launch_marked(full_env)
        launcher = [sys.executable] if nproc is None else torchrun(nproc, **(torchrun_args or {}))
        warm_launcher = warm_forks.command(launcher) if warm else None
        self.warm = warm_launcher is not None
        if self.warm:  # the servers' sockets, unless the test names others
            launcher, full_env = warm_launcher, {**warm_forks.env(), **full_env}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        self.cmd = [*launcher, script, *args]  # script: relative to cwd (the checkout's root by default)
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=full_env, stdout=out,
                                         stderr=subprocess.STDOUT if merge_output else err, start_new_session=True)
        self.started = time.monotonic()

    def output(self) -> str:
        return self.stdout_path.read_text() + self.stderr_path.read_text()

    def pids(self) -> List[int]:
        """Live processes of this launch, found by its marker."""
        return marked_pids(self.marker)

    def signal_all(self, sig) -> None:
        kill(self.pids(), sig)

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float = 120) -> None:
        """Polls ``ready()`` while the launch runs; fails the test if it ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"the launch ended (exit {self.proc.returncode}) before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {what} within {timeout:.0f} s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        self.signal_all(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def finish(self, timeout: float = LAUNCH_TIMEOUT_S, output_root: Optional[Path] = None) -> Finished:
        """Waits for the launch to end, at most ``timeout`` s from now: past it, the test fails with where every
        process of the launch was, and they are all killed."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            where = stacks(self.pids())
            self.kill()
            pytest.fail(f"{' '.join(self.cmd)[:300]}\nran past {timeout:.0f} s (a hung rank?); killed. Where its "
                        f"processes were:\n{where}\n--- its output:\n{self.output()[-4000:]}")
        ended = time.monotonic()
        left = self.pids()
        deadline = ended + 10  # a loader worker or W&B may take a moment after its parent
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.pids()
        names = [cmdline(pid) for pid in left]
        self.signal_all(signal.SIGKILL)
        return Finished(self.proc.returncode, self.stdout_path.read_text(), self.stderr_path.read_text(),
                        output_root, ended, names)


def start(args: List[str], output_root: Optional[Path] = None, *, log_dir: Optional[Path] = None, **kw) -> Launch:
    """Starts ``python train.py output_root=... args`` (or ``script``; under torchrun with ``nproc``) in the
    background. ``output_root`` None: no output_root override (scripts with flags of their own). The output files
    go to ``log_dir`` (default: beside output_root, or a folder of this session's, removed at its end). Other
    keywords: ``Launch``'s."""
    if output_root is not None:
        args = [f"output_root={output_root}", *args]
    if log_dir is None:
        log_dir = output_root.parent / "launch_logs" if output_root is not None else LOGS
    return Launch(args, log_dir, name=uuid.uuid4().hex[:8], **kw)


def launch(args: List[str], output_root: Optional[Path] = None, *, timeout: float = LAUNCH_TIMEOUT_S,
           log_dir: Optional[Path] = None, **kw) -> Finished:
    """``start``'s launch, run to its end (at most ``timeout`` s)."""
    return start(args, output_root, log_dir=log_dir, **kw).finish(timeout, output_root)


def launch_together(args_by_name: Dict[str, List[str]], root: Optional[Path] = None, *,
                    timeout: float = LAUNCH_TIMEOUT_S, each: Optional[Dict[str, Dict]] = None,
                    **kw) -> Dict[str, Finished]:
    """Several independent launches at once, each into ``root / name`` (root None: no output_root, as ``start``):
    on a 2-core machine one launch's waits (process start, rendezvous) are another's compute, so two take about
    0.8x the time of one after the other. ``kw``: ``Launch``'s keywords for all; ``each[name]``: for one."""
    roots = {name: None if root is None else root / name for name in args_by_name}
    started = {name: start(args, roots[name], **{**kw, **(each or {}).get(name, {})})
               for name, args in args_by_name.items()}
    try:
        return {name: one.finish(timeout, roots[name]) for name, one in started.items()}
    finally:
        for one in started.values():  # a launch left running by a failed finish above
            if one.proc.poll() is None:
                one.kill()
