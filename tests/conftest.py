"""Shared helpers: launch train.py the way a user does (python or torchrun) and find its outputs."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    output_root: Path

    @property
    def run_dirs(self) -> List[Path]:
        return sorted(p.parent for p in self.output_root.rglob("config.yaml"))

    @property
    def run_dir(self) -> Path:
        dirs = self.run_dirs
        assert len(dirs) == 1, f"expected one run directory, found {dirs}\n{self.stderr[-3000:]}"
        return dirs[0]

    def results(self) -> Dict:
        return json.loads((self.run_dir / "results.json").read_text())

    def metrics(self) -> List[Dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


def launch(args: List[str], output_root: Path, *, nproc: Optional[int] = None, timeout: float = 300,
           env: Optional[Dict[str, str]] = None, torchrun_args: Optional[List[str]] = None,
           kill_at_step: Optional[str] = None, faults: Optional[Dict[str, str]] = None) -> Finished:
    """Runs ``python train.py args`` (nproc None) or ``torchrun --nproc_per_node=nproc train.py args``.

    ``kill_at_step`` ("STEP" or "STEP:RANK"): through tests/fault_injection.py instead, which
    kills that rank (1 by default) right after that step, on the job's first attempt.
    ``faults``: other tests/fault_injection.py variables (``{QUOTA_AT_STEP_ENV: "12"}``).
    """
    from fault_injection import FAULT_ENVS, KILL_AT_STEP_ENV

    faults = dict(faults or {})
    if kill_at_step is not None:
        faults[KILL_AT_STEP_ENV] = kill_at_step
    script = "train.py" if not faults else "tests/fault_injection.py"
    if nproc is None:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               *(torchrun_args or ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                                   "--rdzv-id=test"]), script]
    full_env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE" and k not in FAULT_ENVS}  # W&B: offline
    full_env.update(faults)
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **(env or {})})
    proc = subprocess.run([*cmd, f"output_root={output_root}", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return Finished(proc.returncode, proc.stdout, proc.stderr, output_root)


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
    from test_real_data import write_idx_mnist

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


@pytest.fixture
def train_here(capsys, tmp_path):
    """Runs train.py's session in this process (one rank, no launch): ``(overrides) -> Finished``.

    The fast way to see what a user sees for a config: exit code, message, files.
    """
    from conf.schema import compose
    from trainer.training import train as run

    def train(overrides: List[str], output_root: Optional[Path] = None) -> Finished:
        output_root = output_root or tmp_path / "outputs"
        cfg = compose([f"output_root={output_root}", "train.progress=false", *overrides])
        code = run(cfg)
        captured = capsys.readouterr()
        return Finished(code, captured.out, captured.err, output_root)

    return train


def torch_loads(path) -> bool:
    """The tests' own oracle for a checkpoint file, independent of trainer.checkpoint: does torch load it?"""
    import torch
    try:
        torch.load(path, weights_only=True)
        return True
    except Exception:
        return False


def cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs; skipped without them (run on the GPU machine)")
    config.addinivalue_line("markers", "fast: in-process, no launches: the edit-test loop (pytest -m fast)")
