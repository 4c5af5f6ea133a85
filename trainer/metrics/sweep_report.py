"""The end of a Hydra multirun (`python train.py -m key=a,b ...`): one table of every job.

Hydra's basic launcher runs the jobs one after another in this process; the session
records each job here (its overrides, run directory and exit code) instead of exiting, so
that a job that fails while running is reported and the sweep goes on. train.py prints
the table when the sweep ends and exits non-zero if any job failed. (Hydra composes each
job as it launches it: an override that does not compose still stops the sweep.)
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

GRAPH_KEYS = ("graph", "graph.mode", "graph.compile_model")


@dataclass
class Job:
    overrides: List[str]
    run_dir: Optional[Path]
    code: int

    def results(self) -> dict:
        path = self.run_dir / "results.json" if self.run_dir else None
        return json.loads(path.read_text()) if path and path.is_file() else {}


JOBS: List[Job] = []


def record(overrides: Sequence[str], run_dir: Optional[Path], code: int) -> None:
    JOBS.append(Job(list(overrides), run_dir, code))


def _others(job: Job) -> frozenset:
    """The job's overrides other than the graph mode: jobs that differ only in mode compare."""
    return frozenset(o for o in job.overrides if o.split("=", 1)[0].lstrip("+~") not in GRAPH_KEYS)


def table(jobs: Sequence[Job]) -> str:
    """Markdown: overrides, status, throughput, speedup over the eager job with the same other overrides, loss."""
    results = [job.results() for job in jobs]  # each results.json read once
    eager = {_others(job): res for job, res in zip(jobs, results) if res.get("mode") == "eager"}
    rows = []
    for job, res in zip(jobs, results):
        unit = "tokens" if "perf/tokens_per_s" in res else "samples"
        rate = res.get(f"perf/{unit}_per_s")
        base = eager.get(_others(job), {}).get(f"perf/{unit}_per_s")
        status = "ok" if job.code == 0 else f"failed (exit {job.code})"
        rows.append([" ".join(job.overrides) or "(defaults)", status, res.get("mode", "—"),
                     f"{rate:,.0f} {unit}/s" if rate else "—",
                     f"{rate / base:.2f}x" if rate and base else "—",
                     f"{res['final/loss']:.4f}" if "final/loss" in res else "—", str(job.run_dir or "—")])
    head = ["job", "status", "mode", "throughput", "speedup vs eager", "final loss", "run dir"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def end_of_sweep() -> int:
    """After `train.py -m ...`: prints one table of every job; 1 if any failed, else 0 (also without a sweep)."""
    if not JOBS:
        return 0
    print("\nsweep:\n" + table(JOBS), flush=True)
    failed = sum(1 for job in JOBS if job.code)
    if failed:
        print(f"{failed} of {len(JOBS)} jobs failed", file=sys.stderr, flush=True)
    return 1 if failed else 0
