"""Checkpoint schedules, fine-tuning from weights and evaluating a checkpoint, in one process.

A job that dies and restarts, a re-run of a finished run, damaged and foreign checkpoints and a
NaN loss are rows of tests/test_fault_table.py (real launches under torchrun)."""
from __future__ import annotations

import json
import re

import pytest

from trainer.checkpoint import list_checkpoints

ARGS = ["recipe.data.source=synthetic", "recipe.data.train_size=4096", "recipe.data.test_size=512",
        "recipe.data.eval_batch_size=256", "train.epochs=2", "train.log_every=8", "checkpoint.every_steps=10",
        "logger=none"]


@pytest.mark.fast
def test_checkpoints_come_every_epoch_and_every_few_minutes_by_default(train_here, out):
    base = [a for a in ARGS if not a.startswith("checkpoint.every_steps")] + ["checkpoint.keep=10"]
    # 1024 samples: 16 steps an epoch; the run ends at step 24, mid-way through the second.
    by_epoch = train_here([*[a for a in base if not a.startswith("recipe.data.train_size")],
                           "recipe.data.train_size=1024", "train.max_steps=24"], out / "epochs")
    assert by_epoch.returncode == 0, by_epoch.stderr[-3000:]
    assert [p.name for p in list_checkpoints(by_epoch.run_dir)] == ["step_00000016.pt", "step_00000024.pt"]
    # The time trigger, checked at log intervals (every 8 steps here): due at every one of them.
    by_time = train_here([*base, "train.max_steps=24", "checkpoint.every_epochs=0", "checkpoint.every_minutes=1e-9"],
                         out / "minutes")
    assert by_time.returncode == 0, by_time.stderr[-3000:]
    assert [p.name for p in list_checkpoints(by_time.run_dir)] == [f"step_{s:08d}.pt" for s in (8, 16, 24)]


def test_fine_tune_from_weights_evaluate_a_checkpoint_and_keep_the_best(train_here, out):
    first = train_here([*ARGS, "train.max_steps=40", "checkpoint.best_metric=eval/accuracy", "train.epochs=1",
                        "recipe.data.train_size=2560"], out / "first")  # 40 steps: one epoch, one evaluation
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir, results = first.run_dir, first.results()
    best = run_dir / "checkpoints" / "best.pt"
    assert best.is_file() and "best eval/accuracy so far" in first.stdout

    # Evaluate that run's newest weights without training: the same numbers, in eval.json; results.json untouched.
    before = (run_dir / "results.json").read_bytes()
    evaluated = train_here([*ARGS, "train.max_steps=40", "train.epochs=1", "recipe.data.train_size=2560",
                            f"run_dir={run_dir}", "train.eval_only=true"], out / "first")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert (run_dir / "results.json").read_bytes() == before
    again = json.loads((run_dir / "eval.json").read_text())
    assert again["final/eval_loss"] == results["final/eval_loss"] and again["steps"] == 40

    # Fine-tune: a new run starts from best.pt's weights (evaluated: exactly the first run's numbers),
    # with a fresh optimizer and step counter.
    from_best = train_here([*ARGS, "train.eval_only=true", f"checkpoint.init_from={best}"], out / "from_best")
    assert from_best.returncode == 0, from_best.stderr[-3000:]
    assert json.loads(next((out / "from_best").rglob("eval.json")).read_text())["final/eval_loss"] == \
        results["final/eval_loss"]
    tuned = train_here([*ARGS, "train.max_steps=5", f"checkpoint.init_from={best}"], out / "tuned")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert f"initialised from the weights of {best}" in tuned.stdout and tuned.results()["steps"] == 5

    wrong = train_here([*ARGS, "recipe=gpt_tiny", "train.max_steps=2", f"checkpoint.init_from={best}"], out / "wrong")
    assert wrong.returncode == 2 and f"checkpoint.init_from={best} cannot start this model" in wrong.stderr


@pytest.mark.fast
def test_checkpoint_save_false_trains_without_writing_any_checkpoint(train_here, out):
    no_cadence = [a for a in ARGS if not a.startswith("checkpoint.every_steps=")]
    done = train_here([*no_cadence, "train.max_steps=12", "checkpoint.save=false"], out / "none")
    assert done.returncode == 0, done.stderr[-3000:]
    assert list_checkpoints(done.run_dir) == [] and done.results()["steps"] == 12  # none: not even at the end
    # a cadence typed beside save=false would mean nothing: refused, naming both keys
    unread = train_here([*ARGS, "checkpoint.save=false"], out / "cadence")
    assert unread.returncode == 2
    assert "checkpoint.every_steps=10 is read only with checkpoint.save=true" in unread.stderr
    refused = train_here([*no_cadence, "checkpoint.save=false", "checkpoint.best_metric=eval/loss"], out / "best")
    assert refused.returncode == 2
    assert "checkpoint.best_metric=eval/loss writes best.pt, but checkpoint.save=false" in refused.stderr


@pytest.mark.fast
def test_a_torchrun_job_dir_starts_with_its_date_and_time_and_its_restart_finds_it_by_the_rdzv_id(
        train_here, out, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # what torchrun sets from --rdzv-id, the same on a restart
    first = train_here([*ARGS, "train.max_steps=10"])
    assert first.returncode == 0, first.stderr[-3000:]
    name = first.run_dir.relative_to(out).as_posix()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}_mnist_eager_job-7", name), name
    # The restart cannot know when the job first started (here: days before): it finds the directory by the id.
    earlier = out / "2020-01-31" / "23-59-58_mnist_eager_job-7"
    earlier.parent.mkdir()
    first.run_dir.rename(earlier)
    restarted = train_here([*ARGS, "train.max_steps=20"])
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert restarted.run_dir == earlier and "resumed from" in restarted.stdout and restarted.results()["steps"] == 20
