"""Damaged checkpoints, as a user meets them: a truncated newest file under retention, and
``checkpoint.resume=`` pointing at a file that cannot be read."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from conftest import torch_loads
from test_resume import ARGS
from trainer.checkpoint import latest_checkpoint, list_checkpoints


def _steps(run_dir):
    return [int(p.stem.split("_")[1]) for p in list_checkpoints(run_dir)]



@pytest.mark.fast
def test_a_resumed_run_that_ends_before_a_truncated_checkpoint_leaves_its_own_as_the_newest(train_here):
    first = train_here([*ARGS, "checkpoint.keep=2", "train.max_steps=30"])
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = first.run_dir
    assert _steps(run_dir) == [20, 30]
    corrupt = run_dir / "checkpoints" / "step_00000030.pt"
    corrupt.write_bytes(corrupt.read_bytes()[: corrupt.stat().st_size // 2])  # as by a full disk

    # Resumes from 20 (30 is skipped) and ends at 25, before the damaged file's step.
    short = train_here([*ARGS, "checkpoint.keep=2", f"run_dir={run_dir}", "train.max_steps=25"])
    text = short.stdout + short.stderr
    assert short.returncode == 0, text[-3000:]
    assert "resumed from" in text and "step_00000020.pt at step 20" in text
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 25
    # keep=2 counts readable files only: the good 20 stays, the truncated 30 is gone.
    assert _steps(run_dir) == [20, 25]
    assert all(torch_loads(p) for p in list_checkpoints(run_dir))
    assert "removing unreadable checkpoint" in text and corrupt.name in text
    path, state = latest_checkpoint(run_dir)
    assert path.name == "step_00000025.pt" and state["step"] == 25

    # And resume=auto next time continues from this run's own newest checkpoint.
    again = train_here([*ARGS, "checkpoint.keep=2", f"run_dir={run_dir}", "train.max_steps=30"])
    text = again.stdout + again.stderr
    assert again.returncode == 0, text[-3000:]
    assert "step_00000025.pt at step 25" in text and "skipping unreadable" not in text
    assert _steps(run_dir) == [25, 30] and all(torch_loads(p) for p in list_checkpoints(run_dir))


def _truncated(path):
    path.write_bytes(path.read_bytes()[:100])


def _garbage(path):
    path.write_bytes(b"not a checkpoint at all")


def _foreign(path):
    # A pickle torch can load only with weights_only=False: the case whose torch error advises exactly that.
    state = torch.load(path, weights_only=True)
    state["args"] = argparse.Namespace(lr=0.1)
    torch.save(state, path)


@pytest.mark.fast
@pytest.mark.parametrize("damage", [_truncated, _garbage, _foreign], ids=["truncated", "garbage", "foreign_pickle"])
def test_resume_from_an_unreadable_file_is_one_message_naming_it(train_here, tmp_path, damage):
    first = train_here([*ARGS, "train.max_steps=10"])
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = list_checkpoints(first.run_dir)[-1]
    damage(ckpt)
    again = train_here([*ARGS, f"checkpoint.resume={ckpt}", "train.max_steps=20"], tmp_path / "other")
    text = again.stdout + again.stderr
    assert again.returncode == 2, text[-3000:]
    assert text.count(str(ckpt)) == 1, text[-3000:]
    assert f"Error: checkpoint.resume={ckpt} cannot be read" in text
    assert "checkpoint.resume=auto" in text
    assert "weights_only" not in text and "Traceback" not in text, text[-3000:]
    assert not list(again.output_root.rglob("results.json"))  # nothing trained
    assert ckpt.exists()  # a file the user named is reported, never removed
