"""A job dies and restarts: it resumes from its newest checkpoint and ends where an
uninterrupted job ends, bit for bit."""
from __future__ import annotations

import json

import pytest

from conftest import free_port, launch
from trainer.checkpoint import list_checkpoints

ARGS = ["recipe.data.source=synthetic", "recipe.data.train_size=4096", "recipe.data.test_size=512",
        "recipe.data.eval_batch_size=256", "train.epochs=2", "train.log_every=8", "checkpoint.every_steps=10",
        "logger=none"]


def _torchrun(max_restarts: int):
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=resume",
            f"--max-restarts={max_restarts}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    clean = launch(ARGS, tmp_path_factory.mktemp("clean"), nproc=2, torchrun_args=_torchrun(0), timeout=240)
    assert clean.returncode == 0, clean.stderr[-3000:]
    return clean


# The host loader (DataLoader workers) resumes at the exact batch too: the same end as the device loader's run.
@pytest.mark.parametrize("loader", ["recipe.data.loader=device", "recipe.data.loader=host recipe.data.num_workers=2"])
def test_a_killed_rank_restarts_resumes_and_matches_an_uninterrupted_run(tmp_path, uninterrupted, loader):
    # Rank 1 dies hard at step 25 (mid-epoch, 5 steps after the step-20 checkpoint).
    crashed = launch([*ARGS, *loader.split()], tmp_path / "crashed", nproc=2, torchrun_args=_torchrun(1),
                     timeout=240, kill_at_step="25:1")
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    text = crashed.stdout + crashed.stderr
    assert "killing this rank" in text and "resumed from" in text and "step_00000020.pt" in text
    a, b = uninterrupted.results(), crashed.results()
    assert b["steps"] == a["steps"] == 64
    assert len(set(a["param_digests"])) == 1
    assert a["param_digests"] == b["param_digests"], "resumed run must equal the uninterrupted one bit for bit"
    assert a["final/eval_loss"] == b["final/eval_loss"]
    kept = list_checkpoints(crashed.run_dir)
    assert [p.name for p in kept] == ["step_00000060.pt", "step_00000064.pt"]  # checkpoint.keep=2


@pytest.mark.fast
def test_resume_auto_skips_a_corrupt_newest_checkpoint(train_here):
    first = train_here([*ARGS, "train.max_steps=30"])
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = first.run_dir
    newest = list_checkpoints(run_dir)[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a full disk
    again = train_here([*ARGS, f"run_dir={run_dir}", "train.max_steps=40"])
    assert again.returncode == 0, again.stderr[-3000:]
    text = again.stdout + again.stderr
    assert newest.name in text  # named in the warning
    assert "resumed from" in text and "step_00000020.pt" in text
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 40


@pytest.mark.fast
def test_a_checkpoint_of_another_recipe_is_refused(train_here, tmp_path):
    first = train_here([*ARGS, "train.max_steps=10"])
    assert first.returncode == 0
    ckpt = list_checkpoints(first.run_dir)[-1]
    import torch
    state = torch.load(ckpt, weights_only=True)
    state["recipe"] = "gpt_tiny"
    torch.save(state, ckpt)
    again = train_here([*ARGS, f"checkpoint.resume={ckpt}"], tmp_path / "other")
    text = again.stdout + again.stderr
    assert again.returncode != 0
    assert text.count("of recipe 'gpt_tiny' but recipe=mnist") == 1, text[-3000:]


@pytest.mark.fast
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(train_here):
    good = train_here([*ARGS, "train.max_steps=10"])
    assert good.returncode == 0, good.stderr[-3000:]
    run_dir = good.run_dir
    # The same run continues with an absurd learning rate (a warm-up schedule rewrites
    # the restored lr every step), so the loss overflows a few steps later.
    done = train_here([*ARGS, f"run_dir={run_dir}", "recipe.optim.lr=1e30", "recipe.schedule.warmup_steps=1",
                       "train.log_every=5", "checkpoint.every_steps=5", "train.max_steps=40"])
    text = done.stdout + done.stderr
    assert done.returncode == 4, text[-3000:]
    assert "resumed from" in text
    assert text.count("the training loss became non-finite") == 1
    failed_at = int(text.split("non-finite (NaN/Inf) by step ")[1].split(":")[0])
    steps_kept = [int(p.stem.split("_")[1]) for p in list_checkpoints(run_dir)]
    assert 10 in steps_kept and max(steps_kept) < failed_at, (steps_kept, failed_at)


def test_rerunning_a_finished_run_leaves_it_alone_and_asking_for_more_extends_it(train_here):
    first = train_here([*ARGS, "train.max_steps=20"])
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = first.run_dir
    results, metrics = (run_dir / "results.json").read_bytes(), (run_dir / "metrics.jsonl").read_text()

    again = train_here([*ARGS, "train.max_steps=20", f"run_dir={run_dir}"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run {run_dir} is complete: 20 of 20 steps done" in again.stdout
    assert (run_dir / "results.json").read_bytes() == results and (run_dir / "metrics.jsonl").read_text() == metrics

    more = train_here([*ARGS, "train.max_steps=30", f"run_dir={run_dir}"])
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in more.stdout and "step_00000020.pt" in more.stdout
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 30
    extended = (run_dir / "metrics.jsonl").read_text()
    assert extended.startswith(metrics) and len(extended) > len(metrics)  # appended, never replaced


@pytest.mark.fast
def test_checkpoints_come_every_epoch_and_every_few_minutes_by_default(train_here, out):
    base = [a for a in ARGS if not a.startswith("checkpoint.every_steps")] + ["checkpoint.keep=10"]
    by_epoch = train_here([*base, "train.max_steps=100"], out / "epochs")  # 64 steps an epoch
    assert by_epoch.returncode == 0, by_epoch.stderr[-3000:]
    assert [p.name for p in list_checkpoints(by_epoch.run_dir)] == ["step_00000064.pt", "step_00000100.pt"]
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
