"""Train a recipe with DDP, eagerly or as one CUDA graph per rank.

    python train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py recipe=mnist graph=full
    python train.py --cfg job                         # print the composed config

compose (Hydra, conf/) → trainer/session.py's train(cfg), the run on one page → exit.
Every rank composes the same config; bad settings are reported once, by rank 0.
"""
from __future__ import annotations

import sys
from pathlib import Path

from trainer.run import process

process.quiet_other_ranks()  # before Hydra: a config error is the same on every rank, rank 0 says it
if __name__ == "__main__":  # before any thread starts: threads inherit the signal mask
    from trainer.run.stop import install as take_stop_signals

    take_stop_signals()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from conf.schema import register_configs  # noqa: E402

register_configs()


_job_started = False  # whether Hydra composed a config and called main


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    global _job_started
    _job_started = True
    process.restore_stderr()
    from trainer.metrics import sweep_report
    from trainer.session import train  # after Hydra: `--help` and config errors stay fast

    code = train(cfg)
    job_dir = process.multirun_job_dir()
    if job_dir is not None:  # one job of `train.py -m`: reported when the sweep ends, and the sweep goes on
        sweep_report.record(process.hydra_overrides(), Path(cfg.run_dir or job_dir), code)
    elif code:
        sys.exit(code)


def compose_and_run() -> None:
    """``main``, where a config Hydra cannot compose exits with the config-error code: Hydra itself
    exits 1, which is a crash's code here (trainer/run/errors.py)."""
    from trainer.run.errors import EXIT_CONFIG, EXIT_CRASH

    try:
        main()
    except SystemExit as stop:
        if stop.code == EXIT_CRASH and not _job_started:
            raise SystemExit(EXIT_CONFIG) from None
        raise


if __name__ == "__main__":
    from trainer.metrics.sweep_report import end_of_sweep

    process.exit_worker(compose_and_run, after=end_of_sweep)
