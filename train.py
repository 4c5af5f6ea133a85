"""Train a recipe with DDP, eagerly or as one CUDA graph per rank.

    python train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py recipe=mnist graph=full
    python train.py --cfg job                         # print the composed config

Every rank composes the same Hydra config; bad settings are reported once, by rank 0.
compose (Hydra, conf/) → build and fit (trainer/session.py) → exit.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


def _silence_other_ranks_stderr():
    """Config errors are the same on every rank: let only rank 0 print Hydra's message."""
    if int(os.environ.get("RANK", "0")) == 0:
        return None
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    return saved


_saved_stderr = _silence_other_ranks_stderr()

if __name__ == "__main__":  # before any thread starts: threads inherit the signal mask
    from trainer.stop import install as _take_stop_signals

    _take_stop_signals()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from conf.schema import register_configs  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    if _saved_stderr is not None:
        os.dup2(_saved_stderr, 2)
    from trainer.session import run  # after Hydra: `--help` and config errors stay fast

    code = run(cfg)
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # report it at the end; the sweep goes on
        from trainer import sweep_report

        run_dir = HydraConfig.get().runtime.output_dir if not cfg.run_dir else cfg.run_dir
        sweep_report.record(HydraConfig.get().overrides.task, Path(run_dir), code)
    elif code:
        sys.exit(code)


def _end_of_sweep() -> int:
    """After `train.py -m ...`: one table of every job; non-zero if any failed."""
    from trainer import sweep_report

    if not sweep_report.JOBS:
        return 0
    print("\nsweep:\n" + sweep_report.table(sweep_report.JOBS), flush=True)
    failed = sum(1 for job in sweep_report.JOBS if job.code)
    if failed:
        print(f"{failed} of {len(sweep_report.JOBS)} jobs failed", file=sys.stderr, flush=True)
    return 1 if failed else 0


def _exit_now(code: int) -> None:
    """Ends a torchrun worker without interpreter finalization.

    Graphs, W&B and the process group are already closed explicitly (trainer/session.py); what
    remains are C++ destructors of communication threads, which have been seen to abort
    ("terminate called without an active exception") when a peer is already gone.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        # When another rank exits first, torchrun sends this one SIGTERM: the signal thread
        # (trainer/stop.py) lets it finish printing its one message rather than dying mid-way.
        if under_torchrun:
            _exit_now(code)
        raise
    sweep_code = _end_of_sweep()
    if under_torchrun:
        _exit_now(sweep_code)
    sys.exit(sweep_code)
