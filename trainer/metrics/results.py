"""Writing a run's results: JSON files, the end-of-run summary, Markdown tables."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List


def write_json(path: Path, obj: Any) -> None:
    """Whole or not at all; a failure for lack of room or rights is a StorageError naming the path (trainer/run/storage.py)."""
    from trainer.run.storage import write_text_atomically

    write_text_atomically(path.name, path, json.dumps(obj, indent=2, default=str) + "\n")


def markdown_table(columns: List[str], rows: List[List[Any]]) -> str:
    def fmt(v):
        return f"{v:,.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_summary(summary: Dict[str, Any]) -> None:
    """The end of a training run on the console: steps, wall time, then the headline numbers."""
    keys = [k for k in summary if k.startswith(("perf/", "graph/", "final/", "time/", "speedup"))]
    width = max(len(k) for k in keys) if keys else 0
    lines = [f"  {k:<{width}}  {summary[k]:.4g}" if isinstance(summary[k], float) else f"  {k:<{width}}  {summary[k]}"
             for k in keys]
    whole = (f"; since process start: first step {summary['time/startup_s']:.2f} s, done {summary['time/total_s']:.2f} s"
             if "time/startup_s" in summary else "")
    print(f"done: {summary['steps']} steps in {summary['train_loop_s']:.2f} s ({summary['mode']}){whole}\n"
          + "\n".join(lines), flush=True)
