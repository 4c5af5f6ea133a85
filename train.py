"""Train a recipe with DDP, eagerly or as one CUDA graph per rank.

    python train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py recipe=mnist graph=full
    python train.py --cfg job                         # print the composed config

compose (Hydra, conf/) → trainer/training.py's train(cfg), the run on one page → exit.
Every rank composes the same config; bad settings are reported once, by rank 0.
"""
from __future__ import annotations

import sys
from pathlib import Path

from trainer import process

process.quiet_other_ranks()  # before Hydra: a config error is the same on every rank, rank 0 says it
if __name__ == "__main__":  # before any thread starts: threads inherit the signal mask
    from trainer.stop import install as take_stop_signals

    take_stop_signals()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from conf.schema import register_configs  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    process.restore_stderr()
    from trainer import sweep_report
    from trainer.training import train  # after Hydra: `--help` and config errors stay fast

    code = train(cfg)
    job_dir = process.multirun_job_dir()
    if job_dir is not None:  # one job of `train.py -m`: reported when the sweep ends, and the sweep goes on
        sweep_report.record(process.hydra_overrides(), Path(cfg.run_dir or job_dir), code)
    elif code:
        sys.exit(code)


if __name__ == "__main__":
    from trainer.sweep_report import end_of_sweep

    process.exit_worker(main, after=end_of_sweep)
