"""Where metrics go: metrics.jsonl in the run directory, and Weights & Biases.

Rank 0 logs (``logger.wandb.all_ranks=true``: every rank logs a W&B run of its own,
grouped, so a slow or diverging rank can be seen). W&B runs offline unless ``logger.wandb.mode`` or ``WANDB_MODE`` says
otherwise, so nothing waits for a network or a key; ``wandb sync <run_dir>/wandb/...``
uploads later. A W&B failure at any point is reported once and logging carries on to
the JSONL file: it never stops training.

W&B starts on a thread of its own (importing it and starting its service takes seconds),
so training does not wait for it: what is logged before it is up waits in order and
goes to W&B once it is. ``finish`` waits for the start (``logger.wandb.init_timeout_s``).
"""
from __future__ import annotations

import json
import os
import random
import string
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

class MetricsLogger:
    def __init__(self, cfg_logger, run_dir: Path, config: Dict[str, Any], *, rank: int, job_type: str,
                 run_id: Optional[str] = None, enabled: bool = True):
        """``run_id``: rank 0's W&B run to continue (resume); ``enabled=False`` logs nothing."""
        self.enabled = enabled and rank == 0  # metrics.jsonl and the summaries
        self.run = None
        self._wandb = None
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1) if self.enabled else None
        self._pending: List[Tuple[str, Callable[[Any], None]]] = []  # W&B calls made before it was up
        self._lock = threading.Lock()
        self._up = False  # True once the start has finished, well or not
        self._starting: Optional[threading.Thread] = None
        wandb_cfg = cfg_logger.wandb
        use_wandb = enabled and cfg_logger.backend.value == "wandb" and (rank == 0 or wandb_cfg.all_ranks)
        # Chosen here, not by W&B, so that a checkpoint written before W&B is up still names its run.
        self.run_id: Optional[str] = (run_id if rank == 0 and run_id else new_run_id()) if use_wandb else None
        self._init_timeout_s = float(wandb_cfg.init_timeout_s)
        if use_wandb:
            self._starting = threading.Thread(
                target=self._start_wandb, args=(wandb_cfg, run_dir, config, job_type, rank, run_id is not None),
                name="wandb-start", daemon=True)
            self._starting.start()

    def _start_wandb(self, cfg, run_dir: Path, config, job_type: str, rank: int, resuming: bool) -> None:
        mode = cfg.mode.value if cfg.mode is not None else os.environ.get("WANDB_MODE") or "offline"
        name, group = cfg.name, cfg.group
        if cfg.all_ranks:  # one run per rank, grouped by job
            name, group = f"{cfg.name or run_dir.name}-rank{rank}", cfg.group or run_dir.name
        run = None
        try:
            import wandb

            run = wandb.init(
                project=cfg.project, entity=cfg.entity, group=group, name=name,
                tags=list(cfg.tags), job_type=cfg.job_type or job_type, config=config,
                dir=str(run_dir), mode=mode, id=self.run_id, resume="allow" if resuming else None,
                settings=wandb.Settings(init_timeout=cfg.init_timeout_s, console="off", silent=True),
            )
            self._wandb = wandb
            run.define_metric("step")
            for prefix in ("train/*", "eval/*", "perf/*", "eager/*", "graph/*"):
                run.define_metric(prefix, step_metric="step")
        except Exception as e:  # no key, no network, bad settings: keep training
            self._wandb_failed("start", e)
            run = None
        with self._lock:  # hand over: the calls made meanwhile, in order, then live calls
            self.run = run
            for what, call in self._pending:
                self._call(what, call)
            self._pending, self._up = [], True

    def _on_wandb(self, what: str, call: Callable[[Any], None]) -> None:
        """Runs ``call(run)`` now, or once W&B is up; a failure turns W&B off, never training."""
        with self._lock:
            if self._starting is not None and not self._up:
                self._pending.append((what, call))
                return
        self._call(what, call)

    def _call(self, what: str, call: Callable[[Any], None]) -> None:
        if self.run is None:
            return
        try:
            call(self.run)
        except Exception as e:
            self._wandb_failed(what, e)

    def _wandb_failed(self, what: str, err: Exception) -> None:
        print(f"[logger] W&B could not {what} ({type(err).__name__}: {err}); training continues, "
              "metrics go to metrics.jsonl. Set logger=none to skip W&B.", file=sys.stderr, flush=True)
        self.run = None

    def log(self, metrics: Dict[str, Any], step: int) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        row = {"step": step, **metrics}
        self._on_wandb("log", lambda run: run.log(row))

    def summary(self, values: Dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"summary": values, "time": time.time()}) + "\n")
        values = dict(values)
        self._on_wandb("write the summary", lambda run: run.summary.update(values))

    def table(self, key: str, columns: List[str], rows: List[List[Any]], bar: Optional[tuple] = None) -> None:
        """A W&B table (and optionally a bar chart of column ``bar[1]`` by ``bar[0]``)."""
        def log_table(run):
            table = self._wandb.Table(columns=columns, data=rows)
            payload = {key: table}
            if bar is not None:
                payload[f"{key}_chart"] = self._wandb.plot.bar(table, bar[0], bar[1], title=key)
            run.log(payload)

        self._on_wandb("log a table", log_table)

    def finish(self, exit_code: int = 0) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._starting is not None:
            self._starting.join(timeout=self._init_timeout_s + 10)
            if self._starting.is_alive():  # W&B never came up: leave it, do not hang the exit
                print(f"[logger] W&B did not start within logger.wandb.init_timeout_s={self._init_timeout_s:g} s; "
                      "its metrics are in metrics.jsonl.", file=sys.stderr, flush=True)
                self.run = None
            self._starting = None
        if self.run is not None:
            try:
                self.run.finish(exit_code=exit_code)
            except Exception as e:
                self._wandb_failed("finish", e)
            self.run = None


def new_run_id() -> str:
    """A W&B run id (8 lowercase letters and digits), made without importing wandb."""
    return "".join(random.SystemRandom().choice(string.ascii_lowercase + string.digits) for _ in range(8))
