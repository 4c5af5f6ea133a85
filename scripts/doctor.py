"""The graph doctor for train.py's step: what would block its capture, or make the captured step wrong.

    python scripts/doctor.py recipe=gpt_tiny                      # the same Hydra overrides as train.py
    python scripts/doctor.py --config-dir my_conf recipe=mine     # your own configs, as train.py --config-dir
    torchrun --nproc_per_node=2 scripts/doctor.py recipe=cifar10_resnet18 train.precision=bf16

Builds the trainer as train.py does (the graph-safe optimizer, DDP on its side stream under
torchrun), runs its training step eagerly for ``graph.warmup_iters`` steps with the doctor's
checks on (graphing/doctor.py), then, on CUDA, tries a capture of one more step and profiles a
few: how launch-bound the eager step is. It prints a table of findings (kind, the file:line
that causes it, the fix), a verdict, the recommended ``graph.capture_error_mode`` and the
expected gain; writes ``doctor.json`` into the run directory and logs the table to W&B (offline
by default; ``logger=none`` for none). Under torchrun every rank checks and rank 0 prints the
merged report. The step is checked as ``graph.mode=full`` would capture it, without
``graph.compile_model``. Without CUDA the checks that need a GPU are skipped and named.

Exit codes:
    0  ready: nothing blocks a capture or makes the captured step wrong
    5  blocked: a capture would fail (the table says where and why)
    6  captures-but-wrong: it captures, then replays a frozen or wrong step (a Python-number lr,
       a branch or shape that changes between steps, ...)
    2  config error (as train.py)
    1  the config does not compose (Hydra's message, as train.py), or a crash
"""
from __future__ import annotations

import argparse
import itertools
import sys
import traceback
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXIT_CONFIG, EXIT_CRASH = 2, 1


def diagnose_trainer(trainer):
    """The doctor's report on ``trainer``'s training step (every rank calls it under torchrun)."""
    from graphing import diagnose

    loader = trainer.train_loader
    count = itertools.count()

    def next_batch() -> tuple:  # what the loop does before each step: new epoch when due, stage the batch
        i = next(count)
        if i % loader.steps == 0:
            loader.start_epoch(i // loader.steps)
        loader.stage()
        return ()

    cuda = trainer.device.type == "cuda"
    report = diagnose(lambda model: trainer.train_step(), trainer.model, trainer.optimizer, next_batch,
                      warmup_iters=trainer.options.warmup_iters, device=trainer.device,
                      stream=getattr(trainer.executor, "side", None), check_optimizer=cuda)
    if not cuda:
        report.notes.append("optimizer not checked here: on CUDA the trainer builds it capturable/fused, and "
                            "trainer/optim.py refuses a class that cannot be captured")
    return report


def main(argv: Optional[List[str]] = None) -> int:
    from trainer.cli import script_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args, cfg = script_config(parser, argv, defaults=["train.progress=false"])
    overrides = args.overrides
    from graphing.doctor import COLUMNS
    from trainer.errors import ConfigError
    from trainer.loop import Trainer, write_json
    from trainer.metrics_logger import MetricsLogger
    from trainer.runtime import env_rank, pick_device, print_once, seed_everything, start
    from trainer.session import tell_torchrun
    from trainer.validate import check_config

    rt = trainer = logger = None
    code = 0
    try:
        check_config(cfg)
        device = pick_device(cfg.device.value)
        # The step as the whole-step graph would capture it (compile and the eager/graph comparison aside).
        cfg.graph.mode = "full" if device.type == "cuda" else "eager"
        cfg.graph.compile_model = False
        cfg.graph.compare = False
        rt = start(device, cfg.output_root, cfg.run_dir, f"{cfg.recipe.name}_doctor")
        seed_everything(cfg.seed, cfg.deterministic)
        trainer = Trainer(cfg, rt)
        rt.make_run_dir()
        print_once(f"graph doctor: recipe {cfg.recipe.name} ({trainer.recipe.data.source} data) | "
                   f"precision {trainer.precision} | {rt.world_size} x {device.type} | run {rt.run_dir}")
        report = diagnose_trainer(trainer)
        code = report.exit_code
        logger = MetricsLogger(cfg.logger, rt.run_dir, trainer.config, rank=rt.rank, job_type="doctor")
        if rt.is_main:
            print(report, flush=True)
            write_json(rt.run_dir / "doctor.json", {"recipe": cfg.recipe.name, "overrides": overrides,
                                                    "precision": trainer.precision, **report.to_dict()})
            logger.table("doctor/findings", COLUMNS, report.rows())
            logger.summary({"doctor/verdict": report.verdict, "doctor/exit_code": report.exit_code,
                            "doctor/finding_count": len(report.findings),
                            "doctor/capture_error_mode": report.capture_error_mode,
                            "doctor/eager_step_ms": report.eager_step_ms, "doctor/gpu_busy_ms": report.gpu_busy_ms})
            print(f"wrote {rt.run_dir / 'doctor.json'}", flush=True)
            if code:  # torchrun's failure report then names the verdict, not only an exit code
                tell_torchrun(f"graph doctor: {report.verdict} (exit {code}); rank 0's table says where and why")
    except ConfigError as e:
        code = EXIT_CONFIG
        print_once(f"Error: {e}", file=sys.stderr)
    except Exception:
        code = EXIT_CRASH
        print(f"[rank {env_rank()}] {traceback.format_exc()}", file=sys.stderr, flush=True)
    finally:
        if trainer is not None:
            trainer.close()
        if logger is not None:  # the doctor's own run ended well whatever its verdict
            logger.finish(exit_code=code if code in (EXIT_CONFIG, EXIT_CRASH) else 0)
        if rt is not None:
            rt.close(clean=code not in (EXIT_CONFIG, EXIT_CRASH))
    return code


if __name__ == "__main__":
    sys.exit(main())
