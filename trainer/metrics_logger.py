"""Where metrics go: metrics.jsonl in the run directory, and Weights & Biases.

Rank 0 logs (``logger.wandb.all_ranks=true``: every rank logs a W&B run of its own,
grouped, so a slow or diverging rank can be seen). W&B runs offline unless ``logger.wandb.mode`` or ``WANDB_MODE`` says
otherwise, so nothing waits for a network or a key; ``wandb sync <run_dir>/wandb/...``
uploads later. A W&B failure at any point is reported once and logging carries on to
the JSONL file: it never stops training.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional


class MetricsLogger:
    def __init__(self, cfg_logger, run_dir: Path, config: Dict[str, Any], *, rank: int, job_type: str,
                 run_id: Optional[str] = None, enabled: bool = True):
        """``run_id``: rank 0's W&B run to continue (resume); ``enabled=False`` logs nothing."""
        self.enabled = enabled and rank == 0  # metrics.jsonl and the summaries
        self.run = None
        self.run_id: Optional[str] = None
        self._wandb = None
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1) if self.enabled else None
        wandb_cfg = cfg_logger.wandb
        if enabled and cfg_logger.backend.value == "wandb" and (rank == 0 or wandb_cfg.all_ranks):
            self._start_wandb(wandb_cfg, run_dir, config, job_type, run_id if rank == 0 else None, rank)

    def _start_wandb(self, cfg, run_dir: Path, config, job_type: str, run_id: Optional[str], rank: int) -> None:
        mode = cfg.mode.value if cfg.mode is not None else os.environ.get("WANDB_MODE") or "offline"
        name, group = cfg.name, cfg.group
        if cfg.all_ranks:  # one run per rank, grouped by job
            name, group = f"{cfg.name or run_dir.name}-rank{rank}", cfg.group or run_dir.name
        try:
            import wandb

            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity, group=group, name=name,
                tags=list(cfg.tags), job_type=cfg.job_type or job_type, config=config,
                dir=str(run_dir), mode=mode, id=run_id, resume="allow" if run_id else None,
                settings=wandb.Settings(init_timeout=cfg.init_timeout_s, console="off", silent=True),
            )
            self._wandb = wandb
            self.run_id = self.run.id
            self.run.define_metric("step")
            for prefix in ("train/*", "eval/*", "perf/*", "eager/*", "graph/*"):
                self.run.define_metric(prefix, step_metric="step")
        except Exception as e:  # no key, no network, bad settings: keep training
            self._wandb_failed("start", e)

    def _wandb_failed(self, what: str, err: Exception) -> None:
        print(f"[logger] W&B could not {what} ({type(err).__name__}: {err}); training continues, "
              "metrics go to metrics.jsonl. Set logger=none to skip W&B.", file=sys.stderr, flush=True)
        self.run = None

    def log(self, metrics: Dict[str, Any], step: int) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.run is not None:
            try:
                self.run.log({"step": step, **metrics})
            except Exception as e:
                self._wandb_failed("log", e)

    def summary(self, values: Dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"summary": values, "time": time.time()}) + "\n")
        if self.run is not None:
            try:
                self.run.summary.update(values)
            except Exception as e:
                self._wandb_failed("write the summary", e)

    def table(self, key: str, columns: List[str], rows: List[List[Any]], bar: Optional[tuple] = None) -> None:
        """A W&B table (and optionally a bar chart of column ``bar[1]`` by ``bar[0]``)."""
        if self.run is None:
            return
        try:
            table = self._wandb.Table(columns=columns, data=rows)
            payload = {key: table}
            if bar is not None:
                payload[f"{key}_chart"] = self._wandb.plot.bar(table, bar[0], bar[1], title=key)
            self.run.log(payload)
        except Exception as e:
            self._wandb_failed("log a table", e)

    def finish(self, exit_code: int = 0) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.run is not None:
            try:
                self.run.finish(exit_code=exit_code)
            except Exception as e:
                self._wandb_failed("finish", e)
            self.run = None
