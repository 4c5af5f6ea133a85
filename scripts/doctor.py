"""The graph doctor for train.py's step: what would block its capture, or make the captured step wrong.

    python scripts/doctor.py recipe=gpt_tiny                      # the same Hydra overrides as train.py
    python scripts/doctor.py --config-dir my_conf recipe=mine     # your own configs, as train.py --config-dir
    torchrun --nproc_per_node=2 scripts/doctor.py recipe=cifar10_resnet18 train.precision=bf16

Builds the trainer as train.py does (the graph-safe optimizer, DDP on its side stream under
torchrun), runs its training step eagerly for ``graph.warmup_iters`` steps with the doctor's
checks on (graphing/doctor/), then, on CUDA, tries a capture of one more step and profiles a
few: how launch-bound the eager step is. It prints a table of findings (kind, the file:line
that causes it, the fix), a verdict, the recommended ``graph.capture_error_mode`` and the
expected gain; writes ``doctor.json`` into the run directory and logs the table to W&B (offline
by default; ``logger=none`` for none). Under torchrun every rank checks and rank 0 prints the
merged report. The step is checked as ``graph.mode=full`` would capture it, without
``graph.compile_model``. Without CUDA the checks that need a GPU are skipped and named.

Exit codes:
    0  ready: nothing blocks a capture or makes the captured step wrong
    7  blocked: a capture would fail (the table says where and why)
    6  captures-but-wrong: it captures, then replays a frozen or wrong step (a Python-number lr,
       a branch or shape that changes between steps, ...)
    2  a setting that cannot work, or a config that does not compose (as train.py)
    1  a crash
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The step as the whole-step graph would capture it: full on CUDA, eager elsewhere (graph.mode=auto),
# without graph.compile_model and the eager/graph comparison.
AS_CAPTURED = ["graph.mode=auto", "graph.compile_model=false", "graph.compare=false"]


def diagnose_trainer(trainer):
    """The doctor's report on ``trainer``'s training step (every rank calls it under torchrun)."""
    from graphing import diagnose

    loader = trainer.train_loader
    count = itertools.count()

    def next_batch() -> tuple:  # what the loop does before each step: new epoch when due, stage the batch
        # (full steps only: the epoch's tail step is a graph of its own, of the same code)
        i = next(count)
        if i % loader.shapes.full_steps == 0:
            loader.start_epoch(i // loader.shapes.full_steps)
        loader.stage()
        return ()

    cuda = trainer.plan.device.type == "cuda"
    report = diagnose(lambda model: trainer.train_step(), trainer.model, trainer.optimizer, next_batch,
                      warmup_iters=trainer.plan.graph.warmup_iters, device=trainer.plan.device,
                      stream=getattr(trainer.executor, "side", None), check_optimizer=cuda,
                      max_graphs=trainer.plan.graph.max_graphs)
    if not cuda:
        report.notes.append("optimizer not checked here: on CUDA the trainer builds it capturable/fused, and "
                            "trainer/step/optim.py refuses a class that cannot be captured")
    return report


def doctor_job(session, overrides: List[str]) -> int:
    """Builds the run as train.py does, diagnoses its step, reports: the verdict's exit code."""
    from graphing.doctor import COLUMNS
    from trainer.metrics.results import write_json
    from trainer.run.runtime import print_once
    from trainer.run.process import tell_torchrun

    cfg, trainer = session.cfg, session.build()
    rt = trainer.rt
    session.open_run_dir()
    print_once(f"graph doctor: recipe {cfg.recipe.name} ({trainer.recipe.data.source} data) | "
               f"precision {trainer.plan.precision} | {rt.world_size} x {rt.device.type} | run {rt.run_dir}")
    report = diagnose_trainer(trainer)
    logger = session.open_logger(trainer.config, job_type="doctor")
    if rt.is_main:
        print(report, flush=True)
        write_json(rt.run_dir / "doctor.json", {"recipe": cfg.recipe.name, "overrides": overrides,
                                                "precision": trainer.plan.precision, **report.to_dict()})
        logger.table("doctor/findings", COLUMNS, report.rows())
        logger.summary({"doctor/verdict": report.verdict, "doctor/exit_code": report.exit_code,
                        "doctor/finding_count": len(report.findings),
                        "doctor/capture_error_mode": report.capture_error_mode,
                        "doctor/eager_step_ms": report.eager_step_ms, "doctor/gpu_busy_ms": report.gpu_busy_ms})
        print(f"wrote {rt.run_dir / 'doctor.json'}", flush=True)
        if report.exit_code:  # torchrun's failure report then names the verdict, not only an exit code
            tell_torchrun(f"graph doctor: {report.verdict} (exit {report.exit_code}); rank 0's table says "
                          "where and why")
    return report.exit_code


def main(argv: Optional[List[str]] = None) -> int:
    from trainer.run.cli import script_config
    from trainer.session import Session

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args, cfg = script_config(parser, argv, defaults=["train.progress=false"], fixed=AS_CAPTURED)
    return Session(cfg, purpose="doctor").execute(lambda session: doctor_job(session, args.overrides))


if __name__ == "__main__":
    sys.exit(main())
