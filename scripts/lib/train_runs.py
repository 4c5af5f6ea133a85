"""One train.py run of a benchmark, read back: its results.json, and the host memory of all its processes.

Benchmarks that compare settings across whole runs (scripts/bench_watchdog.py, scripts/bench_images.py) start each
run here: the command runs through launch.run_captured (its own session, every process ended on a timeout or a
Ctrl-C), and a run that fails or runs past its time ends the benchmark with the run's last lines. While it runs,
a thread adds up the proportional set size (PSS: a page shared by n processes counts 1/n in each) of every process
the run started, its loader workers included, once a second: their peak is the run's host memory, what
results.json's perf/peak_host_mib (the rank's own process) leaves out. The same thread reads the CPU time those
processes used in each second, the cores they kept busy, for the whole tree and for the launched process alone (a
rank without its loader workers): the median second of the run's timed steps (results.json's wall window) says
whether the run's decoding had the machine's cores to itself or ran short of them, and how much of them the training
process took.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import psutil

from scripts.lib import process_tree
from scripts.lib.launch import run_captured

SAMPLE_S = 1.0


class TreeUsage:
    """The peak, over samples taken every ``SAMPLE_S``, of the summed PSS of the processes marked ``mark``; and the
    cores they kept busy in each sample's interval (CPU seconds over wall seconds): ``peak_cores``, the busiest
    interval's, and ``samples``, every interval's: (its start and end on the wall clock, time.time(); the whole
    tree's cores; the launched processes' own: those whose parent is not marked, without their children, e.g. a
    rank without its loader workers)."""

    def __init__(self, mark: str):
        self.mark, self.peak_mib = mark, 0.0
        self.samples: List[Tuple[float, float, float, float]] = []  # (start, end, tree cores, launched processes')
        self._cpu_s: Dict[int, float] = {}  # each process's CPU seconds at the last sample
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tree-usage", daemon=True)

    def __enter__(self) -> "TreeUsage":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    @property
    def peak_cores(self) -> float:
        return max((tree for _, _, tree, _ in self.samples), default=0.0)

    def cores_between(self, start: float, end: float) -> Tuple[float, float]:
        """The median interval among those whose middle falls in [start, end] (wall clock), or the one nearest that
        window where it is shorter than a sample: (the tree's cores, the launched processes' own); zeros before any
        sample."""
        if not self.samples:
            return 0.0, 0.0
        inside = [s for s in self.samples if start <= (s[0] + s[1]) / 2 <= end]
        if not inside:
            middle = (start + end) / 2
            inside = [min(self.samples, key=lambda s: abs((s[0] + s[1]) / 2 - middle))]
        return statistics.median(s[2] for s in inside), statistics.median(s[3] for s in inside)

    def _watch(self) -> None:
        last = time.time()
        while not self._done.wait(SAMPLE_S):
            total, busy_s, own_s, cpu_s = 0, 0.0, 0.0, {}
            pids = set(process_tree.marked_pids(self.mark))
            for pid in pids:
                try:
                    process = psutil.Process(pid)
                    info, times, parent = process.memory_full_info(), process.cpu_times(), process.ppid()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                total += getattr(info, "pss", info.rss)  # PSS where the system reports it (Linux)
                cpu_s[pid] = times.user + times.system
                busy = cpu_s[pid] - self._cpu_s.get(pid, cpu_s[pid])  # a process new since the last look: from now
                busy_s += busy
                own_s += busy if parent not in pids else 0.0
            now = time.time()
            self.peak_mib = max(self.peak_mib, total / 2**20)
            if pids and now > last:
                self.samples.append((last, now, busy_s / (now - last), own_s / (now - last)))
            self._cpu_s, last = cpu_s, now


def run_until_written(script: str, name: str, command: List[str], written: Path, timeout: float,
                      env: Optional[Dict[str, str]] = None) -> None:
    """Runs ``command``, which must exit 0 having written ``written``; otherwise the benchmark ends (SystemExit)
    naming ``name``, how it ended and its last lines."""
    stdout, stderr, code = run_captured(command, timeout, env=env, name=name)
    if code != 0 or not written.is_file():
        tail = "\n".join((stderr or stdout).strip().splitlines()[-5:])
        how = f"ran past {timeout:g} s" if code is None else f"exited {code}"
        raise SystemExit(f"{script}: {name} {how}:\n{tail}")


def measured_run(script: str, name: str, command: List[str], written: Path, timeout: float) -> TreeUsage:
    """run_until_written with every process it starts marked and watched: the returned TreeUsage holds their host
    memory and busy cores over the run."""
    env, mark = process_tree.marked(dict(os.environ))
    with TreeUsage(mark) as usage:
        run_until_written(script, name, command, written, timeout, env={process_tree.MARK: env[process_tree.MARK]})
    return usage


def train_results(script: str, name: str, command: List[str], run_dir: Path, timeout: float) -> Dict[str, Any]:
    """Runs ``command`` (a train.py launch writing into ``run_dir``) and returns its results.json with
    ``host/tree_peak_mib``, ``host/tree_peak_cores`` and the median cores over the timed steps, ``host/tree_cores``
    (every process of the run) and ``host/launched_cores`` (the launched process alone: a rank without its
    workers), added; a failure or a timeout ends the benchmark (SystemExit) naming ``name``. The timed steps: the
    ``perf/wall_s`` seconds that ended ``time/after_last_step_s`` before results.json was written (the whole run
    where results.json has no wall window)."""
    results = run_dir / "results.json"
    began = time.time()
    usage = measured_run(script, name, command, results, timeout)
    values = json.loads(results.read_text())
    ended = results.stat().st_mtime - values.get("time/after_last_step_s", 0.0)
    tree_cores, launched_cores = usage.cores_between(ended - (values.get("perf/wall_s") or ended - began), ended)
    return {**values, "host/tree_peak_mib": usage.peak_mib,
            "host/tree_peak_cores": usage.peak_cores, "host/tree_cores": tree_cores,
            "host/launched_cores": launched_cores}
