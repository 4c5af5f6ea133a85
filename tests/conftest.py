"""The tests' fixtures and pytest hooks, nothing else. What tests import (launching, processes, skips, ...) is in
tests/helpers/ (``from helpers.launches import launch``), importable through pytest.ini's ``pythonpath``.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import List, Optional

import pytest

from helpers import two_streams, warm
from helpers.launches import LOGS, Finished, launch
from helpers.processes import SESSION, marked_pids
from helpers.shared_runs import TWO_RANKS_ON_CIFAR
from scripts.lib.process_tree import kill


@pytest.fixture(scope="session", autouse=True)
def no_launch_outlives_the_session():
    """A launch a test abandoned (an error between start and finish), and the warm servers (helpers/warm.py), are
    killed when the session ends."""
    yield
    warm.close()
    kill(marked_pids(SESSION))
    shutil.rmtree(LOGS, ignore_errors=True)


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "outputs"


@pytest.fixture(scope="session")
def debug_run_with_host_workers_and_a_broken_wandb(tmp_path_factory) -> Finished:
    """``python train.py experiment=debug`` whose host loader has worker processes and whose W&B
    cannot start (WANDB_MODE=not-a-mode): one launch, read by test_data and test_training."""
    return launch(["experiment=debug", "train.progress=false", "recipe.data.loader=host",
                   "recipe.data.num_workers=2"], tmp_path_factory.mktemp("debug_host") / "outputs", timeout=90,
                  env={"WANDB_MODE": "not-a-mode"})


@pytest.fixture(scope="session")
def mnist_files(tmp_path_factory) -> Path:
    """A small MNIST in torchvision's raw format (2048 train, 300 test images) under ``<root>/MNIST/raw``."""
    from helpers.mnist_files import write_idx_mnist

    root = tmp_path_factory.mktemp("mnist_files") / "data"
    write_idx_mnist(root, 2048, 300)
    return root


@pytest.fixture(scope="session")
def two_ranks_on_mnist_files(tmp_path_factory, mnist_files) -> Finished:
    """Two gloo ranks, 8 steps on the MNIST files found under recipe.data.root (source=auto), each rank
    logging its own W&B run (offline): one launch, read by test_real_data and test_training."""
    return launch([f"recipe.data.root={mnist_files}", "recipe.data.source=auto", "recipe.data.eval_batch_size=128",
                   "train.max_steps=8", "train.log_every=8", "logger.wandb.all_ranks=true"],
                  tmp_path_factory.mktemp("real_data") / "outputs", nproc=2, timeout=120)


@pytest.fixture(scope="session")
def two_ranks_on_cifar(tmp_path_factory) -> Finished:
    """Two gloo ranks, one epoch of cifar10_resnet18 (helpers.shared_runs.TWO_RANKS_ON_CIFAR): one launch, read
    by test_recipes and test_ddp_settings."""
    return launch(TWO_RANKS_ON_CIFAR, tmp_path_factory.mktemp("cifar") / "outputs", nproc=2, timeout=180)


@pytest.fixture
def train_here(capsys, tmp_path):
    """Runs train.py's session in this process (one rank, no launch): ``(overrides) -> Finished``.

    The fast way to see what a user sees for a config: exit code, message, files.
    """
    from conf.schema import compose
    from trainer.session import train as run

    def train(overrides: List[str], output_root: Optional[Path] = None) -> Finished:
        output_root = output_root or tmp_path / "outputs"
        cfg = compose([f"output_root={output_root}", "train.progress=false", *overrides])
        code = run(cfg)
        captured = capsys.readouterr()
        return Finished(code, captured.out, captured.err, output_root)

    return train


def pytest_configure(config):
    config.pluginmanager.register(two_streams, "two_streams")  # the suite on two streams where it pays
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs; skipped without them (run on the GPU machine)")
    config.addinivalue_line("markers", "extras: needs an optional extra (requirements-hf.txt); skipped without it")
    config.addinivalue_line("markers", "fast: in-process, no launches: the edit-test loop (pytest -m fast)")
