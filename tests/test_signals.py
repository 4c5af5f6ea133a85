"""Ctrl-C and SIGTERM, sent for real to real processes: nothing hangs, nothing is lost.

| signal                         | what the user sees                                   | exit            |
|--------------------------------|------------------------------------------------------|-----------------|
| SIGINT (Ctrl-C) under torchrun | one line per rank, all gone within 5 s               | torchrun's own  |
| SIGINT to `python train.py`    | one line                                             | 130             |
| SIGTERM under torchrun         | ranks agree on a step, checkpoint, exit within 10 s; | torchrun's own  |
|                                | the resumed run ends bit for bit like an unbroken one|                 |
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port
from trainer.checkpoint import list_checkpoints

# 16 steps per epoch on each of 2 ranks; long enough to be interrupted in the middle.
ARGS = ["experiment=debug", "train.max_steps=null", "train.epochs=30", "train.log_every=8", "train.eval=false",
        "logger=none", "train.progress=false"]
OURS = ('train.py", line', "trainer/", "recipes/", "graphing/")


def _start(args, output_root: Path, nproc=2):
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=signals"] if nproc else [sys.executable]
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    # A session of its own, like a terminal's job: the signal goes to torchrun and every rank.
    return subprocess.Popen([*launcher, "train.py", f"output_root={output_root}", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _signal_mid_training(proc, output_root: Path, sig, rows: int = 2):
    """Waits for ``rows`` logged training rows, sends ``sig`` to the job; (seconds to exit, output)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = list(output_root.rglob("metrics.jsonl"))
        if found and found[0].read_text().count('"train/loss"') >= rows:
            break
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    sent = time.monotonic()
    os.killpg(proc.pid, sig)
    try:
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return time.monotonic() - sent, output


def _left_behind(proc) -> bool:
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_ctrl_c_under_torchrun_stops_every_rank_at_once(tmp_path):
    proc = _start(ARGS, tmp_path)
    seconds, output = _signal_mid_training(proc, tmp_path, signal.SIGINT)
    print(f"SIGINT: all processes gone {seconds:.2f} s after the signal")
    assert seconds < 5, output[-3000:]
    assert output.count("interrupted (SIGINT): stopping now") == 2, output[-3000:]  # one line per rank
    assert not any(mark in output for mark in OURS), output[-3000:]  # torchrun's own report only
    assert not _left_behind(proc)


def test_ctrl_c_of_one_process_exits_130(tmp_path):
    proc = _start(ARGS, tmp_path, nproc=None)
    seconds, output = _signal_mid_training(proc, tmp_path, signal.SIGINT)
    assert proc.returncode == 130 and seconds < 5, output[-3000:]
    assert output.count("interrupted (SIGINT)") == 1 and "Traceback" not in output


def test_sigterm_checkpoints_at_an_agreed_step_and_resume_matches_an_unbroken_run(tmp_path):
    clean = _start(ARGS, tmp_path / "clean")
    output, _ = clean.communicate(timeout=240)
    assert clean.returncode == 0, output[-3000:]
    [clean_results] = list((tmp_path / "clean").rglob("results.json"))

    run_dir = tmp_path / "preempted" / "run"
    proc = _start([*ARGS, f"run_dir={run_dir}"], tmp_path / "preempted")
    seconds, output = _signal_mid_training(proc, tmp_path / "preempted", signal.SIGTERM)
    print(f"SIGTERM: all processes gone {seconds:.2f} s after the signal")
    assert seconds < 10, output[-3000:]
    assert output.count("stopped on SIGTERM at step") == 1 and f"run_dir={run_dir}" in output, output[-3000:]
    stopped_at = int(output.split("stopped on SIGTERM at step ")[1].split(",")[0])
    assert [p.name for p in list_checkpoints(run_dir)][-1] == f"step_{stopped_at:08d}.pt"
    assert 0 < stopped_at < 30 * 16 and not (run_dir / "results.json").exists()
    assert not _left_behind(proc)

    resumed = _start([*ARGS, f"run_dir={run_dir}"], tmp_path / "preempted")
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, output[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:08d}.pt'}" in output
    a = json.loads(clean_results.read_text())
    b = json.loads((run_dir / "results.json").read_text())
    assert a["steps"] == b["steps"] == 30 * 16
    assert a["param_digests"] == b["param_digests"], "preempted and resumed must equal unbroken, bit for bit"


@pytest.mark.fast
def test_one_process_checks_its_own_flag_and_ranks_agree_on_a_spacing_in_seconds():
    from trainer.stop import StopAgreement

    class OneProcess:
        distributed = False

    agreement = StopAgreement(OneProcess())
    agreement.start(0)
    assert not agreement.should_stop(1)  # no SIGTERM yet, and no collective needed to know it
