"""train.parallel=fsdp2 as a user runs it on the CPU: two gloo ranks train a GPT as DDP does, its
checkpoints resume on another world size and start DDP runs (and the other way round), and every
combination FSDP2 cannot carry is refused with one message naming the setting.

SIGTERM, retention and a damaged checkpoint under fsdp2 are rows of tests/test_fault_table.py; the
graphed step on a GPU is tests/test_fsdp_gpu.py.
"""
from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
import yaml

from helpers.fault_injection import GATHER_REPORT, REPORT_GATHERS_ENV
from helpers.launches import launch_together
from trainer.checkpoint import list_checkpoints
from trainer.checkpoint.layout import SHARDS_SUFFIX, temp_dir

# A GPT small enough for seconds on two CPU ranks: 8 steps of 2 x 8 windows of 32 tokens.
GPT = ["recipe=gpt_tiny", "recipe.model.n_layer=2", "recipe.model.n_head=2", "recipe.model.d_model=64",
       "recipe.model.context=32", "recipe.data.source=synthetic", "recipe.data.train_size=256",
       "recipe.data.test_size=64", "recipe.data.batch_size=8", "recipe.data.eval_batch_size=32",
       "train.max_steps=8", "train.epochs=1", "train.log_every=1", "train.precision=fp32", "train.grad_clip=1.0",
       "logger=none", "train.progress=false"]


def losses(run_dir) -> list:
    return [row["train/loss"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in row]


@pytest.fixture(scope="module")
def ddp_and_fsdp2(tmp_path_factory):
    """The same GPT run under DDP and under FSDP2 (its blocks sharded one by one), two gloo ranks each, two
    micro-batches a step (DDP's no_sync, FSDP2's set_requires_gradient_sync(False) on the first)."""
    root = tmp_path_factory.mktemp("fsdp2")
    runs = launch_together({parallel: [*GPT, f"train.parallel={parallel}", "train.grad_accum=2"]
                            for parallel in ("ddp", "fsdp2")}, root, nproc=2, timeout=180,
                           each={"fsdp2": {"faults": {REPORT_GATHERS_ENV: "1"}}})
    for run in runs.values():
        assert run.returncode == 0, run.output[-3000:]
    return runs


def test_fsdp2_trains_a_gpt_on_two_ranks_as_ddp_does(ddp_and_fsdp2):
    ddp, fsdp2 = ddp_and_fsdp2["ddp"], ddp_and_fsdp2["fsdp2"]
    for done in (ddp, fsdp2):  # what every 2-rank run of a recipe writes (tests/test_recipes.py)
        res = done.results()
        assert res["recipe"] == "gpt_tiny" and res["world_size"] == 2 and res["data_source"] == "synthetic"
        assert res["steps"] == 8 and math.isfinite(res["final/loss"]) and math.isfinite(res["final/eval_loss"])
        assert res["perf/tokens_per_s"] > 0 and "perf/mfu_pct" not in res  # MFU only on a GPU with a known peak
        assert len(set(res["param_digests"])) == 1  # DDP's replicas alike; fsdp2's one digest of all shards
        assert yaml.safe_load((done.run_dir / "config.yaml").read_text())["recipe"]["data"]["source_used"] == \
            "synthetic"
    # Same seed, same weights, same data: the losses of every step agree to fp32 rounding (the gradient
    # reductions add in another order), as do the final weights, gathered whole on every rank.
    assert losses(fsdp2.run_dir) == pytest.approx(losses(ddp.run_dir), rel=1e-5)
    assert len(losses(ddp.run_dir)) == 8
    a, b = ddp.results(), fsdp2.results()
    assert b["final/eval_loss"] == pytest.approx(a["final/eval_loss"], rel=1e-5)
    # Digested on the device over the shards, summed over the ranks: no parameter was gathered whole, in the
    # run or at its end (its checkpoints are each rank's own shards).
    assert GATHER_REPORT not in fsdp2.output, fsdp2.output[-3000:]
    config = yaml.safe_load((fsdp2.run_dir / "config.yaml").read_text())
    assert config["train"]["parallel"] == "fsdp2" and config["train"]["fsdp"]["blocks_used"] == 2
    assert "names no blocks" not in fsdp2.output


def test_a_two_rank_fsdp2_checkpoint_resumes_on_one_rank_and_starts_ddp_runs_and_back(ddp_and_fsdp2, train_here,
                                                                                      tmp_path):
    ddp, fsdp2 = ddp_and_fsdp2["ddp"], ddp_and_fsdp2["fsdp2"]
    # Another world size: the 2-rank fsdp2 run, asked for more steps, goes on in one process (a group of one).
    run_dir = tmp_path / "one_rank"
    shutil.copytree(fsdp2.run_dir, run_dir)
    more = train_here([*GPT, "train.parallel=fsdp2", "train.grad_accum=2", "train.max_steps=10", f"run_dir={run_dir}"])
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"resumed from {list_checkpoints(fsdp2.run_dir)[-1]}".replace(str(fsdp2.run_dir), str(run_dir)) in more.stdout
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 10 and len(losses(run_dir)) == 10

    # Weights cross between the two ways of training: a DDP checkpoint evaluated under fsdp2, and an
    # fsdp2 checkpoint under DDP, give their own run's evaluation.
    for source, parallel in ((ddp, "fsdp2"), (fsdp2, "ddp")):
        checkpoint = list_checkpoints(source.run_dir)[-1]
        evaluated = train_here([*GPT, f"train.parallel={parallel}", "train.eval_only=true",
                                f"checkpoint.init_from={checkpoint}"], tmp_path / f"into_{parallel}")
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        result = json.loads(next((tmp_path / f"into_{parallel}").rglob("eval.json")).read_text())
        assert result["final/eval_loss"] == pytest.approx(source.results()["final/eval_loss"], rel=1e-5)


@pytest.mark.fast
def test_fsdp2_on_one_process_shards_over_a_group_of_one_and_trains_as_without_it(train_here, tmp_path):
    one = train_here([*GPT, "train.parallel=fsdp2", "train.max_steps=3"], tmp_path / "fsdp2")
    plain = train_here([*GPT, "train.max_steps=3"], tmp_path / "ddp")
    assert one.returncode == 0 and plain.returncode == 0, one.stderr[-3000:] + plain.stderr[-3000:]
    assert losses(one.run_dir) == losses(plain.run_dir)  # one rank, fp32: bit for bit
    assert not torch.distributed.is_initialized()  # the group of one is gone with the run


@pytest.mark.fast
def test_a_meta_device_build_draws_its_own_shards_and_trains(train_here, tmp_path):
    meta = train_here([*GPT, "train.parallel=fsdp2", "train.fsdp.init=meta", "train.max_steps=3"], tmp_path / "meta")
    host = train_here([*GPT, "train.parallel=fsdp2", "train.max_steps=3"], tmp_path / "host")
    assert meta.returncode == 0 and host.returncode == 0, meta.stderr[-3000:] + host.stderr[-3000:]
    # Drawn on the device after sharding: other numbers than the host build's, from the same init (a loss
    # near ln(vocab) = 5.55 at the first step, as a well-scaled random GPT has).
    assert meta.results()["param_digests"] != host.results()["param_digests"]
    assert losses(meta.run_dir)[0] == pytest.approx(5.545, abs=0.1)
    refused = train_here(["recipe=mnist", "train.parallel=fsdp2", "train.fsdp.init=meta", "logger=none",
                          "recipe.data.source=synthetic", "train.max_steps=1"], tmp_path / "mnist")
    assert refused.returncode == 2
    assert "train.fsdp.init=meta: recipe 'mnist' built its model on the host" in refused.stderr


@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", [
    (["train.fsdp.reshard_after_forward=false"],
     "train.fsdp.reshard_after_forward=false is a setting of train.parallel=fsdp2, but this run uses "
     "train.parallel=ddp"),
    (["train.parallel=fsdp2", "train.ddp.bucket_cap_mb=5"],
     "train.ddp.bucket_cap_mb=5.0 is a setting of train.parallel=ddp, but this run uses train.parallel=fsdp2"),
    (["train.parallel=fsdp2", "train.precision=fp32", "train.fsdp.reduce_dtype=bf16"],
     "train.fsdp.reduce_dtype=bf16 reduces bf16 gradients, but train.precision resolves to fp32"),
])
def test_settings_of_the_other_parallel_or_that_fsdp2_cannot_carry_are_refused(train_here, overrides, message):
    refused = train_here([*GPT, *overrides])
    assert refused.returncode == 2 and refused.stderr.count(message) == 1, refused.stderr[-3000:]


@pytest.mark.fast
@pytest.mark.parametrize("graph, precision, optim, message", [
    ("full", "fp16", "torch.optim.AdamW", "train.precision=fp16 with train.parallel=fsdp2"),
    ("partial", "bf16", "torch.optim.AdamW", "graph=partial with train.parallel=fsdp2"),
    ("compile", "bf16", "torch.optim.AdamW", "graph=compile with train.parallel=fsdp2"),
    ("full", "bf16", "torch.optim.SGD", "recipe.optim._target_=torch.optim.SGD under train.parallel=fsdp2 with a "
                                        "whole-step graph"),
])
def test_what_a_gpu_run_under_fsdp2_cannot_carry_is_refused_by_name(graph, precision, optim, message):
    # The plan's own check, with the choices a GPU machine resolves to (this one has none).
    from conf.schema import compose
    from graphing import GraphMode, GraphOptions
    from trainer.run.errors import ConfigError
    from trainer.step.optim import optimizer_spec
    from trainer.parallel.sharding import fsdp_spec

    cfg = compose([*GPT, "train.parallel=fsdp2", f"recipe.optim._target_={optim}", "~recipe.optim.betas",
                   "~recipe.optim.weight_decay"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        options = GraphOptions(mode=GraphMode.full, compile_model=True) if graph == "full_compiled" else \
            GraphOptions(mode=GraphMode(graph))
        optimizer = optimizer_spec(cfg.recipe.optim)
        fsdp_spec(cfg, precision, options, optimizer.target, optimizer.cls)


@pytest.mark.fast
def test_a_half_written_sharded_checkpoint_is_never_resumed_and_retention_clears_it(train_here, tmp_path, caplog):
    run_dir = tmp_path / "run"
    args = [*GPT, "train.parallel=fsdp2", f"run_dir={run_dir}", "checkpoint.every_steps=1", "checkpoint.keep=2"]
    first = train_here([*args, "train.max_steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    kept = list_checkpoints(run_dir)
    assert [p.name for p in kept] == ["step_00000001.dcp", "step_00000002.dcp"] and all(p.is_dir() for p in kept)
    # A newer step whose DCP metadata never got written (a save killed mid-way), and a killed save's temp directory.
    damaged = run_dir / "checkpoints" / "step_00000009.dcp"
    shutil.copytree(kept[-1], damaged)
    (damaged / ".metadata").unlink()
    temp = temp_dir(run_dir, 3, SHARDS_SUFFIX)
    temp.mkdir()
    more = train_here([*args, "train.max_steps=4"])
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"resumed from {kept[-1]} at step 2" in more.stdout
    assert "skipping unreadable checkpoint" in caplog.text and "without .metadata" in caplog.text
    assert not damaged.exists() and not temp.exists()
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000003.dcp", "step_00000004.dcp"]
