"""A user trains with their own loop through graphing.GraphedStep (scripts/own_loop.py).

The script runs as a real subprocess, under plain python or torchrun, the way a user
starts it. CPU tests hide any GPU (CUDA_VISIBLE_DEVICES=""), so they check the CPU
behaviour (gloo, eager; full refused) on every machine. The GPU test runs eager and full
with the same seed and compares them step for step.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from conftest import ROOT, free_port

SCRIPT = "scripts/own_loop.py"
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def run_own_loop(args: List[str], *, nproc: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 timeout: float = 180) -> subprocess.CompletedProcess:
    """``python scripts/own_loop.py args`` (nproc None) or the same under torchrun with nproc processes."""
    if nproc is None:
        cmd = [sys.executable, SCRIPT]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=own_loop", SCRIPT]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*cmd, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def results_of(proc: subprocess.CompletedProcess, path: Path) -> Dict:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(path.read_text())


def expected_lr(t: int, schedule: Dict) -> float:
    """The schedule the script states (linear warm-up, then cosine to min), in plain Python."""
    peak, low, warmup, total = schedule["peak"], schedule["min"], schedule["warmup"], schedule["total"]
    if t < warmup:
        return peak * (t + 1) / warmup
    progress = min(1.0, max(0.0, (t - warmup) / max(1, total - warmup)))
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress))


def assert_lr_schedule_followed(res: Dict) -> None:
    """Every step used the lr of its own index: the device-side counter advanced on every step."""
    lrs = res["lrs"]
    assert len(lrs) == res["steps"]
    for t, lr in enumerate(lrs):
        assert lr == pytest.approx(expected_lr(t, res["lr_schedule"]), rel=1e-5), f"step {t}: lr {lr}"


# --- CPU ------------------------------------------------------------------------------------------

def test_two_ranks_without_cuda_run_the_loop_eagerly_and_learn(tmp_path):
    output = tmp_path / "eager.json"
    # No --mode: without CUDA the default is eager.
    proc = run_own_loop(["--steps", "30", "--log-every", "10", "--output", str(output)], nproc=2, env=NO_GPU)
    res = results_of(proc, output)

    assert (res["mode"], res["world_size"], res["device"], res["steps"]) == ("eager", 2, "cpu", 30)
    assert res["info"]["mode"] == "eager" and res["info"]["capture_error_mode"] is None
    assert res["steps_by_phase"] == {"warmup": 11, "eager": 19}
    digests = res["param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], f"ranks disagree on the parameters: {digests}"

    losses = res["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) and x > 0 for x in losses)  # every step wrote its slot
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, f"loss did not fall: first five {first:.4f}, last five {last:.4f}"
    assert_lr_schedule_followed(res)

    assert proc.stdout.count("own_loop: mode=eager world_size=2") == 1, proc.stdout  # rank 0 speaks, once
    assert "step    30/30 | loss" in proc.stdout and "on every rank" in proc.stdout


@pytest.mark.parametrize("nproc", [2], ids=["torchrun2"])  # one rank's case is the same code, printing once
def test_full_without_cuda_fails_once_with_graphings_message(tmp_path, nproc):
    output = tmp_path / "full.json"
    proc = run_own_loop(["--mode", "full", "--steps", "20", "--output", str(output)], nproc=nproc, env=NO_GPU)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert text.count("needs a CUDA GPU") == 1, text  # rank 0 only, however many ranks
    assert "mode=full needs a CUDA GPU but this machine has no usable CUDA GPU" in text
    assert 'own_loop.py", line' not in text, f"the script printed a traceback:\n{text}"  # torchrun's own may follow
    assert not output.exists()


# --- GPU ------------------------------------------------------------------------------------------

LOSS_TOL = 1e-3  # absolute, on losses of order 0.3..2.3; a frozen lr or stale inputs moves them by 1e-2 and more
PARAM_TOL = 1e-4  # relative to each parameter's sum of |values|


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_matches_eager_step_for_step(tmp_path):
    nproc = 2 if torch.cuda.device_count() >= 2 else 1
    steps, warmup = 60, 11
    runs = {}
    for mode in ("eager", "full"):
        output = tmp_path / f"{mode}.json"
        proc = run_own_loop(["--mode", mode, "--steps", str(steps), "--seed", "3", "--warmup-iters", str(warmup),
                             "--log-every", "20", "--output", str(output)], nproc=nproc, timeout=300)
        runs[mode] = results_of(proc, output)
        print(proc.stdout)
    eager, full = runs["eager"], runs["full"]

    # full really graphed: one capture after the warm-up, every later step a replay
    assert full["info"]["mode"] == "full" and full["info"]["capture_error_mode"] == "global"
    assert full["info"]["train_capture_s"] > 0
    assert full["steps_by_phase"] == {"warmup": warmup, "capture": 1, "graph": steps - warmup - 1}
    assert eager["info"]["mode"] == "eager" and "train_capture_s" not in eager["info"]
    for res in (eager, full):
        assert res["world_size"] == nproc and res["device"] == "cuda"
        assert len(set(res["param_digests"])) == 1, res["param_digests"]

    # the schedule advanced on every replay (a captured host-side lr would stay at its capture value)
    assert_lr_schedule_followed(full)
    assert_lr_schedule_followed(eager)
    assert len(set(full["lrs"][warmup:])) > steps - warmup - 5

    loss_diff = max(abs(a - b) for a, b in zip(eager["losses"], full["losses"]))
    lr_diff = max(abs(a - b) for a, b in zip(eager["lrs"], full["lrs"]))
    param_diff = max(max(abs(e[0] - f[0]), abs(e[1] - f[1])) / max(e[1], 1e-12)
                     for e, f in ((eager["param_stats"][k], full["param_stats"][k]) for k in eager["param_stats"]))
    print(f"nproc={nproc}: max |loss eager - full| = {loss_diff:.3e}, max |lr diff| = {lr_diff:.3e}, "
          f"max param-sum diff (relative) = {param_diff:.3e}, digests eager {eager['param_digests'][0]} "
          f"full {full['param_digests'][0]}")
    assert len(eager["losses"]) == len(full["losses"]) == steps
    assert loss_diff < LOSS_TOL
    assert lr_diff < 1e-9
    assert param_diff < PARAM_TOL
    # the comparison can fail: the losses move far more over the run than the tolerance allows
    assert full["losses"][0] - full["losses"][-1] > 50 * LOSS_TOL
