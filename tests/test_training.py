"""A user trains on CPU: under torchrun with gloo, and as one process; W&B runs offline."""
from __future__ import annotations

import pytest

from helpers.launches import launch
from helpers.wandb_offline import find_runs, read_run

# 4000 samples on 2 ranks at 64: 31 full steps and the tail, 32 samples (16 per rank), per epoch.
# train.max_steps is above the 2 epochs' 64 steps: the epochs end the run.
SMALL = ["recipe.data.source=synthetic", "recipe.data.train_size=4000", "recipe.data.test_size=1000",
         "recipe.data.eval_batch_size=256", "train.epochs=2", "train.max_steps=100", "train.log_every=8"]


# A closed local proxy makes this machine offline for the download, whatever its network.
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Two gloo ranks for 2 epochs of 32 steps each (the last a partial one), the README's first command on a machine with
    no MNIST files and no internet (recipe.data.source=auto falls back): what every test below reads."""
    root = tmp_path_factory.mktemp("ddp")
    done = launch([*SMALL, "recipe.data.source=auto", f"recipe.data.root={root / 'empty'}", "graph=auto",
                   "logger.wandb.group=cpu-test", "logger.wandb.tags=[ci]"], root / "outputs", nproc=2, env=OFFLINE)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_auto_source_falls_back_to_synthetic_with_one_warning(ddp_run):
    assert (ddp_run.stdout + ddp_run.stderr).count("training on SYNTHETIC data") == 1
    assert ddp_run.results()["data_source"] == "synthetic"


def test_two_rank_gloo_run_keeps_replicas_identical(ddp_run):
    results = ddp_run.results()
    assert results["world_size"] == 2 and results["steps"] == 2 * (4000 // 2 // 64 + 1)  # the tail is a step
    assert results["mode"] == "eager" and results["precision"] == "fp32"  # graph=auto, precision=auto: no CUDA
    digests = results["param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert results["final/eval_samples"] == 1000  # every test sample counted once, across both ranks


def test_the_run_says_its_fixed_costs(ddp_run):
    results = ddp_run.results()
    # Launch to the first step; the first step itself; the last step's end to the results written.
    assert 0 < results["time/startup_s"] < results["time/total_s"]
    assert 0 < results["time/first_step_s"] < results["train_loop_s"]
    assert 0 <= results["time/after_last_step_s"] < 10
    assert results["time/input_wait_s"] == 0  # synthetic data on the device loader: no workers to wait for
    assert "time/until_first_graph_step_s" not in results  # no graph on the CPU
    # rank 0's peak host memory: the interpreter, torch and the run (a model loaded on the host would show here)
    assert 100 < results["perf/peak_host_mib"] < 8192
    assert "perf/peak_reserved_mib" not in results  # no GPU


def test_one_run_directory_holds_every_rank_log_and_the_metrics(ddp_run):
    run_dir = ddp_run.run_dir  # asserts there is exactly one
    assert (run_dir / "rank0.log").exists() and (run_dir / "rank1.log").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "overrides.yaml").exists()
    rows = ddp_run.metrics()
    train_rows = [r for r in rows if "train/loss" in r]
    eval_rows = [r for r in rows if "eval/accuracy" in r]
    assert len(train_rows) >= 8 and len(eval_rows) == 2
    assert all(r["perf/samples_per_s"] > 0 for r in train_rows)
    assert "source_used: synthetic" in (run_dir / "config.yaml").read_text()
    assert "mode_used: eager" in (run_dir / "config.yaml").read_text()


def test_wandb_offline_run_holds_the_logged_keys(ddp_run):
    runs = find_runs(ddp_run.run_dir)
    assert len(runs) == 1, "only rank 0 logs to W&B"
    run = read_run(runs[0])
    assert run.group == "cpu-test" and run.job_type == "eager" and run.tags == ["ci"]
    assert {"train/loss", "train/accuracy", "perf/samples_per_s", "eval/loss", "eval/accuracy"} <= run.keys()
    assert run.config["recipe"]["name"] == "mnist" and run.config["world_size"] == 2
    assert run.summary["steps"] == 64 and run.summary["perf/samples_per_s"] > 0
    assert run.exit_code == 0


def test_every_rank_can_log_its_own_grouped_wandb_run(two_ranks_on_mnist_files):
    done = two_ranks_on_mnist_files  # logger.wandb.all_ranks=true, train.max_steps=8
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [read_run(path) for path in find_runs(done.run_dir)]
    assert len(runs) == 2
    assert {r.group for r in runs} == {done.run_dir.name}
    assert all("train/loss" in r.keys() and r.summary["steps"] == 8 for r in runs)
    assert len({r.run_id for r in runs}) == 2
    assert len([r for r in done.metrics() if "train/loss" in r]) == 1  # one row at step 8, from rank 0 only


@pytest.mark.fast
def test_synthetic_data_is_learnable(train_here):
    # 2 epochs of 4000 images (125 steps) with momentum 0.9 learn it as well as 12000 images (375 steps) with the
    # recipe's 0.5 did (measured: 0.967 and 0.984; random labels would stay near 0.1): a third of the time.
    done = train_here(["recipe.data.source=synthetic", "recipe.data.train_size=4000", "recipe.data.test_size=1000",
                       "train.epochs=2", "recipe.optim.momentum=0.9", "logger=none"])
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = done.results()["final/eval_accuracy"]
    assert accuracy > 0.8, f"10 classes: chance is 0.1, got {accuracy}"


@pytest.mark.fast
def test_host_loader_feeds_the_same_batches_as_the_device_loader(train_here, out):
    # One epoch of 1000 samples: 15 whole batches of 64 and a tail of 40, through both loaders.
    args = [*[a for a in SMALL if not a.startswith("recipe.data.train_size")], "recipe.data.train_size=1000",
            "train.epochs=1", "logger=none", "train.log_every=4"]
    device = train_here([*args, "recipe.data.loader=device"], out / "device")
    host = train_here([*args, "recipe.data.loader=host"], out / "host")
    assert device.returncode == 0 and host.returncode == 0, host.stderr[-3000:]
    d, h = device.results(), host.results()
    assert d["param_digests"] == h["param_digests"]
    assert d["final/eval_loss"] == h["final/eval_loss"]


def test_a_broken_wandb_never_stops_training(debug_run_with_host_workers_and_a_broken_wandb):
    done = debug_run_with_host_workers_and_a_broken_wandb  # WANDB_MODE=not-a-mode
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("W&B could not start") == 1
    assert any("train/loss" in r for r in done.metrics())  # the JSONL still has everything


def test_a_trainer_that_dies_still_leaves_its_wandb_run_closed_and_marked_failed(out):
    # The W&B sidecar sees its pipe close without a finish: it finishes the run itself, failed.
    done = launch([*SMALL, "train.log_every=2", "train.eval=false"], out,
                  kill_at_step="5:0")
    assert done.returncode == 13, done.stderr[-3000:]
    [path] = find_runs(done.run_dir)
    run = read_run(path)
    assert run.exit_code == 1
    assert [r["step"] for r in run.history if "train/loss" in r] == [2, 4]


@pytest.mark.fast
def test_log_interval_and_max_steps(train_here):
    done = train_here([*SMALL, "train.max_steps=10", "train.log_every=3", "train.eval=false", "logger=none"])
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r["step"] for r in done.metrics() if "train/loss" in r]
    assert steps == [3, 6, 9, 10]
    assert done.results()["steps"] == 10
