"""One session: from a composed config to an exit code, for train.py and every script.

``Session(cfg, purpose).execute(job)`` owns the lifecycle, in this order:

    plan the run (every check that needs no data, before the ranks meet: trainer/plan.py)
    → join the process group and agree on a run directory (trainer/runtime.py)
    → logging (held in memory until the run directory exists) → seeds
    → job(session): builds the run (``session.build()``, trainer/assembly.py), opens the run
      directory and the metrics logger when it needs them, does its work, returns its code
    → teardown, on every path, in reverse: graphs and loaders (before the process group),
      the metrics logger (W&B), the process group, the log handlers.

Each expected failure becomes one message, printed by rank 0, and an exit code; a crash
prints its traceback once per rank and exits 1, except a collective that lost its peer (a
rank killed or crashed elsewhere): one line from rank 0, the trace in each rank's log file.
``run(cfg)`` is train.py's job. Whatever a run must hold for its whole life (a lock on its run
directory, trainer/run_lock.py) is taken in ``_start`` and given back in ``_close``.
"""
from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

EXIT_CONFIG, EXIT_CAPTURE, EXIT_NONFINITE, EXIT_STORAGE, EXIT_CRASH = 2, 3, 4, 5, 1  # and trainer/stop.py: 130, 143

log = logging.getLogger("train")


class Session:
    """``purpose`` names the run directory (``<recipe>_<purpose>``; default: the graph mode)."""

    def __init__(self, cfg, purpose: Optional[str] = None):
        self.cfg, self.purpose = cfg, purpose
        self.plan = self.rt = self.run = self.logger = None
        self._handlers: List[logging.Handler] = []

    def execute(self, job: Callable[["Session"], int]) -> int:
        """Runs ``job(self)`` inside the session; returns the process's exit code."""
        from graphing import CaptureError
        from trainer.errors import ConfigError, NonFiniteLossError, Preempted, StorageError
        from trainer.plan import graph_setting
        from trainer.runtime import env_rank, print_once
        from trainer.stop import EXIT_PREEMPTED, stop_requested

        code, clean = 0, False  # clean: the ranks end together (no peer is gone)
        failed_together = False  # a clean end that is still a failure for the W&B run (storage, SIGTERM)
        try:
            self._start()
            code = job(self) or 0  # a job's own verdict (the doctor's) is a clean end for its W&B run
            clean = True
        except (ConfigError, CaptureError, NonFiniteLossError, StorageError) as e:
            code = next(c for kind, c in ((ConfigError, EXIT_CONFIG), (CaptureError, EXIT_CAPTURE),
                                          (NonFiniteLossError, EXIT_NONFINITE), (StorageError, EXIT_STORAGE))
                        if isinstance(e, kind))
            clean = failed_together = isinstance(e, StorageError)  # every rank raised it after one broadcast
            said = e.render(graph_setting) if isinstance(e, CaptureError) else str(e)  # in this trainer's words
            message = f"Error: {said}"
            print_once(message, file=sys.stderr)
            if env_rank() == 0:  # the same on every rank: once in the report too
                tell_torchrun(message)
        except Preempted as e:  # every rank agreed on the step and the checkpoint is written: an orderly end
            code, clean, failed_together = EXIT_PREEMPTED, True, True
            print_once(str(e), file=sys.stderr)
        except Exception as e:
            code = EXIT_CRASH
            text = traceback.format_exc()
            if peer_gone(e) or stop_requested():  # not this rank's fault: one line, the trace in its log file
                # (torchrun stops the survivors of a failed rank with SIGTERM, their loader workers too)
                log.info("a peer rank is gone or the job is being stopped:\n%s", text)
                if stop_requested():
                    code = EXIT_PREEMPTED
                said = (f"[rank {env_rank()}] stopping: another rank is gone or the job is being stopped "
                        f"({_first_line(e)}); torchrun restarts the job if --max-restarts allows, and its report "
                        "names the rank that failed first")
                print_once(said, file=sys.stderr)
                tell_torchrun(said)
            else:
                log.error("crashed:\n%s", text)  # the rank's log file; rank 0's console too
                if self.rt is None or not self.rt.is_main:
                    print(f"[rank {env_rank()}] {text}", file=sys.stderr, flush=True)
                tell_torchrun(text)
        finally:
            self._close(logger_code=code if failed_together or not clean else 0, clean=clean)
        return code

    def _start(self) -> None:
        from trainer.plan import plan_run
        from trainer.runtime import pick_device, seed_everything, start

        cfg = self.cfg
        device = pick_device(cfg.device.value)
        self.plan = plan_run(cfg, device, int(os.environ.get("WORLD_SIZE", "1")))
        name = f"{cfg.recipe.name}_{self.purpose or self.plan.mode}"
        self.rt = start(device, cfg.output_root, cfg.run_dir or multirun_job_dir(), name,
                        take_over_run_dir=cfg.take_over_run_dir)
        self._handlers = _start_logging(self.rt)
        seed_everything(cfg.seed, cfg.deterministic)

    def build(self):
        """The run's parts (trainer/assembly.py), built once; the session closes them."""
        from trainer.assembly import build_run

        self.run = build_run(self.plan, self.rt)
        return self.run

    def open_run_dir(self) -> Path:
        """Creates the run directory (only once the run is built: a config error found while
        building leaves no directory behind); from here on each rank logs to rank<N>.log."""
        self.rt.make_run_dir()
        _log_to_file(self.rt, self._handlers[0])
        return self.rt.run_dir

    def open_logger(self, config: Dict[str, Any], job_type: str, run_id: Optional[str] = None):
        """The metrics logger (metrics.jsonl, W&B) of this session; finished at teardown."""
        from trainer.metrics_logger import MetricsLogger

        self.logger = MetricsLogger(self.cfg.logger, self.rt.run_dir, config, rank=self.rt.rank,
                                    job_type=job_type, run_id=run_id)
        return self.logger

    def _close(self, logger_code: int, clean: bool) -> None:
        if self.run is not None:
            self.run.close()  # graphs before the process group, or exit can hang
        if self.logger is not None:
            self.logger.finish(exit_code=logger_code)
        if self.rt is not None:
            self.rt.close(clean=clean)
        for handler in self._handlers:  # a second session in this process (tests, notebooks) logs to its own files
            logging.getLogger().removeHandler(handler)
            target = getattr(handler, "target", None)
            handler.close()
            if target is not None:
                target.close()


# ---- train.py's job ----------------------------------------------------------------------

def run(cfg) -> int:
    """Trains as ``cfg`` says; returns the process's exit code (0: done)."""
    code = Session(cfg).execute(_train)
    job_dir = multirun_job_dir()
    if job_dir is not None:  # one job of `train.py -m`: reported when the sweep ends (train.py)
        from trainer import sweep_report

        sweep_report.record(_overrides(), Path(cfg.run_dir or job_dir), code)
    return code


def _train(session: Session) -> int:
    from trainer.loop import Trainer
    from trainer.errors import StorageError
    from trainer.results import print_summary, write_json
    from trainer.runtime import print_once
    from trainer.storage import write_text_atomically

    cfg, run = session.cfg, session.build()
    rt = run.rt
    start_step, wandb_run_id = run.state.resume(cfg.checkpoint)  # before any warm-up or capture
    if start_step >= run.total_steps and not cfg.train.eval_only:  # a finished run: leave it alone
        results = rt.run_dir / "results.json"
        where = (f"results in {results}" if results.exists() else  # its final write failed (exit 5)
                 f"{results.name} could not be written at its end: its summary is the last row of metrics.jsonl")
        print_once(f"run {rt.run_dir} is complete: {start_step} of {run.total_steps} steps done; {where}. "
                   "Ask for more (train.epochs, train.max_steps) to continue it, or set run_dir=... for a new run")
        return 0
    session.open_run_dir()
    failed = None
    if rt.is_main:
        try:
            write_text_atomically("config.yaml", rt.run_dir / "config.yaml", OmegaConf.to_yaml(run.config))
            write_text_atomically("overrides.yaml", rt.run_dir / "overrides.yaml", OmegaConf.to_yaml(_overrides()))
        except StorageError as e:
            failed = run.state.storage_advice(str(e))
    run.state.agree_on_storage(failed)
    print_once(f"run {rt.run_dir} | recipe {cfg.recipe.name} ({run.recipe.data.source} data) | "
               f"mode {run.plan.mode} | {rt.world_size} x {rt.device.type} | "
               f"{run.steps_per_epoch} steps/epoch of {run.global_batch} samples")
    log.info("config:\n%s", OmegaConf.to_yaml(run.config))
    logger = session.open_logger(run.config, job_type=run.plan.mode, run_id=wandb_run_id)
    summary = Trainer(run, logger, start_step).fit()
    log.info("summary: %s", summary)
    failed = None
    if rt.is_main:  # an evaluation of a run's weights never replaces that run's results
        print_summary(summary)
        try:
            logger.write_pending()  # rows a full disk held back since the last checkpoint
            write_json(rt.run_dir / ("eval.json" if cfg.train.eval_only else "results.json"), summary)
        except StorageError as e:
            failed = run.state.storage_advice(str(e))
    run.state.agree_on_storage(failed)  # a run whose results are not on disk does not exit 0
    return 0


# ---- the process around a session -------------------------------------------------------

def tell_torchrun(message: str) -> None:
    """Puts ``message`` in torchrun's failure report (its per-worker error file), in place of
    "To enable traceback see ...": the report then names the cause, not only an exit code."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    entry = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
    try:
        with open(path, "w") as f:
            json.dump({"message": entry}, f)
    except OSError:
        pass  # the report falls back to its generic line


def peer_gone(e: BaseException) -> bool:
    """Whether ``e`` says a collective lost its peer (a rank killed or crashed), rather than a bug here."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistBackendError", None)) if k)
    text = str(e)
    return isinstance(e, kinds) or (isinstance(e, RuntimeError) and any(
        mark in text for mark in ("Connection reset by peer", "Connection closed by peer", "gloo/transport/tcp",
                                  "Broken pipe", "NCCL communicator was aborted")))


def _first_line(e: BaseException) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {line[:160]}"


def multirun_job_dir():
    """Under `train.py -m`, the job's folder of Hydra's sweep directory; None otherwise."""
    from hydra.types import RunMode

    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # composed without @hydra.main
        return None
    return hydra_cfg.runtime.output_dir if hydra_cfg.mode == RunMode.MULTIRUN else None


def _overrides():
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # composed without @hydra.main (tests, scripts)
        return []


def _start_logging(rt) -> list:
    """The root logger's handlers for this run: [records kept until the run directory exists,
    rank 0's console for warnings (synthetic data, W&B, graph fallbacks), once]."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    held = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
    root.addHandler(held)
    if not rt.is_main:
        return [held]
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    root.addHandler(console)
    return [held, console]


def _log_to_file(rt, held) -> None:
    """From here on the rank's records go to rank<N>.log, beginning with those held so far."""
    handler = _QuietFileHandler(rt.run_dir / f"rank{rt.rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    held.setTarget(handler)
    held.flush()
    held.flushLevel = logging.DEBUG  # pass every later record straight through
    held.capacity = 1


class _QuietFileHandler(logging.FileHandler):
    """A rank's log file that a full disk cannot turn into tracebacks: a failed record is said once.

    (logging's default prints "--- Logging error ---" and a traceback for every record.)
    """

    _said = False

    def handleError(self, record) -> None:
        if not self._said:
            self._said = True
            from trainer.runtime import print_once

            print_once(f"[logger] cannot write {self.baseFilename} ({sys.exc_info()[1]}); its records are lost "
                       "from here", file=sys.stderr)
