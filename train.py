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
from omegaconf import DictConfig  # noqa: E402

from conf.schema import register_configs  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    if _saved_stderr is not None:
        os.dup2(_saved_stderr, 2)
    from trainer.session import multirun_job_dir, run  # after Hydra: `--help` and config errors stay fast

    code = run(cfg)
    if code and multirun_job_dir() is None:  # in a sweep the job is reported at the end and the sweep goes on
        sys.exit(code)


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
    from trainer.sweep_report import end_of_sweep

    sweep_code = end_of_sweep()
    if under_torchrun:
        _exit_now(sweep_code)
    sys.exit(sweep_code)
