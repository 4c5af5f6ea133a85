"""One training session, from a composed config to an exit code.

check the config → join the process group and agree on a run directory → build the
Trainer → fit → write results → release graphs, W&B and the process group, in that
order, on every path. Each expected failure becomes one message, printed by rank 0,
and an exit code.
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

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

EXIT_CONFIG, EXIT_CAPTURE, EXIT_NONFINITE, EXIT_CRASH = 2, 3, 4, 1  # and trainer/stop.py: 130, 143

log = logging.getLogger("train")


def run(cfg) -> int:
    """Trains as ``cfg`` says; returns the process's exit code (0: done)."""
    from graphing import CaptureError
    from trainer.errors import ConfigError, NonFiniteLossError, Preempted
    from trainer.stop import EXIT_PREEMPTED
    from trainer.loop import Trainer, write_json
    from trainer.metrics_logger import MetricsLogger
    from trainer.runtime import env_rank, pick_device, print_once, seed_everything, start
    from trainer.validate import check_config, graph_options

    rt = trainer = logger = None
    handlers = []
    code = 0
    try:
        # Everything that can be checked without data is checked before the ranks meet.
        check_config(cfg)
        device = pick_device(cfg.device.value)
        mode = graph_options(cfg, device, int(os.environ.get("WORLD_SIZE", "1"))).mode
        rt = start(device, cfg.output_root, cfg.run_dir or multirun_job_dir(), f"{cfg.recipe.name}_{mode}")
        handlers = _start_logging(rt)
        seed_everything(cfg.seed, cfg.deterministic)
        trainer = Trainer(cfg, rt)
        if trainer.start_step >= trainer.total_steps and not cfg.train.eval_only:  # a finished run: leave it alone
            print_once(f"run {rt.run_dir} is complete: {trainer.start_step} of {trainer.total_steps} steps done; "
                       f"results in {rt.run_dir / 'results.json'}. Ask for more (train.epochs, train.max_steps) "
                       "to continue it, or set run_dir=... for a new run")
            return code
        rt.make_run_dir()  # only now: a config error found while building leaves no directory behind
        _log_to_file(rt, handlers[0])
        config = trainer.config
        if rt.is_main:
            (rt.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config))
            (rt.run_dir / "overrides.yaml").write_text(OmegaConf.to_yaml(_overrides()))
        print_once(f"run {rt.run_dir} | recipe {cfg.recipe.name} ({trainer.recipe.data.source} data) | "
                   f"mode {mode} | {rt.world_size} x {device.type} | "
                   f"{trainer.steps_per_epoch} steps/epoch of {trainer.global_batch} samples")
        log.info("config:\n%s", OmegaConf.to_yaml(config))
        logger = MetricsLogger(cfg.logger, rt.run_dir, config, rank=rt.rank, job_type=mode,
                               run_id=trainer.wandb_run_id)
        summary = trainer.fit(logger)
        log.info("summary: %s", summary)
        if rt.is_main:  # an evaluation of a run's weights never replaces that run's results
            write_json(rt.run_dir / ("eval.json" if cfg.train.eval_only else "results.json"), summary)
            _print_summary(summary)
    except (ConfigError, CaptureError, NonFiniteLossError) as e:
        code = next(c for kind, c in ((ConfigError, EXIT_CONFIG), (CaptureError, EXIT_CAPTURE),
                                      (NonFiniteLossError, EXIT_NONFINITE)) if isinstance(e, kind))
        print_once(f"Error: {e}", file=sys.stderr)
        if env_rank() == 0:  # the same on every rank: once in the report too
            tell_torchrun(f"Error: {e}")
    except Preempted as e:  # every rank agreed on the step and the checkpoint is written: an orderly end
        code = EXIT_PREEMPTED
        print_once(str(e), file=sys.stderr)
    except Exception:
        code = EXIT_CRASH
        text = traceback.format_exc()
        log.error("crashed:\n%s", text)  # the rank's log file; rank 0's console too
        if rt is None or not rt.is_main:
            print(f"[rank {env_rank()}] {text}", file=sys.stderr, flush=True)
        tell_torchrun(text)
    finally:
        if trainer is not None:
            trainer.close()  # graphs before the process group, or exit can hang
        if logger is not None:
            logger.finish(exit_code=code)
        if rt is not None:
            rt.close(clean=code in (0, EXIT_PREEMPTED))
        for handler in handlers:  # a second session in this process (tests, notebooks) logs to its own files
            logging.getLogger().removeHandler(handler)
            target = getattr(handler, "target", None)
            handler.close()
            if target is not None:
                target.close()
    job_dir = multirun_job_dir()
    if job_dir is not None:  # one job of `train.py -m`: reported when the sweep ends (train.py)
        from trainer import sweep_report

        sweep_report.record(_overrides(), Path(cfg.run_dir or job_dir), code)
    return code


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
    handler = logging.FileHandler(rt.run_dir / f"rank{rt.rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    held.setTarget(handler)
    held.flush()
    held.flushLevel = logging.DEBUG  # pass every later record straight through
    held.capacity = 1


def _print_summary(summary) -> None:
    keys = [k for k in summary if k.startswith(("perf/", "graph/", "final/", "time/", "speedup"))]
    width = max(len(k) for k in keys) if keys else 0
    lines = [f"  {k:<{width}}  {summary[k]:.4g}" if isinstance(summary[k], float) else f"  {k:<{width}}  {summary[k]}"
             for k in keys]
    whole = (f"; since process start: first step {summary['time/startup_s']:.2f} s, done {summary['time/total_s']:.2f} s"
             if "time/startup_s" in summary else "")
    print(f"done: {summary['steps']} steps in {summary['train_loop_s']:.2f} s ({summary['mode']}){whole}\n"
          + "\n".join(lines), flush=True)
