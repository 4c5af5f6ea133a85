"""A user lists conf/, picks groups and overrides values: every combination composes,
and every choice the framework owns is refused at compose time when it is not one of
the choices, with the choices listed."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from conf.schema import compose
from helpers.launches import launch
from helpers.paths import ROOT

CONF = ROOT / "conf"


def options(group: str):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.fast
def test_every_group_combination_composes_with_its_own_recipe_and_mode():
    # Every recipe × mode; the experiments (none, compare, debug) rotate so that every recipe meets each of them
    # and every mode meets each of them; the loggers (independent of the rest) alternate.
    recipes, graphs, experiments = options("recipe"), options("graph"), [None, *options("experiment")]
    assert len(recipes) == 7  # mnist, cifar10_resnet18, torchvision_classifier, gpt_tiny, gpt2_small, gpt_1b, hf_causal_lm
    combos = [(recipe, graph, experiments[(r + g) % len(experiments)])
              for r, recipe in enumerate(recipes) for g, graph in enumerate(graphs)]
    assert {(c[0], c[2]) for c in combos} == set(itertools.product(recipes, experiments))
    assert {(c[1], c[2]) for c in combos} == set(itertools.product(graphs, experiments))
    loggers = itertools.cycle(options("logger"))
    for (recipe, graph, experiment), logger in zip(combos, loggers):
        overrides = [f"recipe={recipe}", f"graph={graph}", f"logger={logger}"]
        if experiment:
            overrides.append(f"experiment={experiment}")
        cfg = compose(overrides)
        assert cfg.recipe.name == recipe
        assert cfg.recipe._target_.startswith("recipes.") and cfg.recipe._target_.endswith(".build")
        # The group's file decides the mode unless an experiment preset overrides it.
        expected = {"full_compiled": "full"}.get(graph, graph) if experiment != "compare" else "full"
        assert cfg.graph.mode.value == expected
        assert cfg.graph.compile_model == (graph == "full_compiled")
        assert cfg.logger.backend.value == logger


@pytest.mark.fast
def test_defaults_are_the_readme_defaults():
    cfg = compose([])
    assert cfg.recipe.name == "mnist" and cfg.recipe._target_ == "recipes.mnist.build"
    assert cfg.graph.mode.value == "auto" and cfg.graph.warmup_iters == 11
    assert cfg.graph.capture_error_mode.value == "global" and cfg.graph.on_failure.value == "fail"
    assert cfg.recipe.data.source == "auto" and cfg.recipe.data.batch_size == 64
    assert dict(cfg.recipe.optim) == {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.01, "momentum": 0.5}
    assert dict(cfg.recipe.schedule) == {"_target_": "trainer.step.schedules.Constant", "_partial_": True, "warmup_steps": 0}
    assert cfg.train.epochs == 10 and cfg.device.value == "auto"
    assert cfg.logger.backend.value == "wandb" and cfg.logger.wandb.mode is None  # offline unless told
    ddp = cfg.train.ddp  # bucket_cap_mb null: torch's own buckets (a 1 MiB first one, then 25 MiB)
    assert (ddp.bucket_cap_mb, ddp.grad_reduce.value, ddp.static_graph, ddp.broadcast_buffers) == \
        (None, "fp32", False, True)
    # A BatchNorm recipe turns the per-forward buffer broadcast off (BatchNorm trains on batch statistics)
    assert compose(["recipe=cifar10_resnet18"]).train.ddp.broadcast_buffers is False
    assert compose(["recipe=cifar10_resnet18", "train.ddp.broadcast_buffers=true"]).train.ddp.broadcast_buffers


@pytest.mark.fast
@pytest.mark.parametrize("key,choices", [
    ("graph.capture_error_mode", "global, thread_local, relaxed"),
    ("graph.mode", "auto, eager, full, partial, compile"),
    ("graph.on_failure", "fail, eager"),
    ("device", "auto, cpu, cuda"),
    ("recipe.data.loader", "auto, device, host"),
    ("train.precision", "fp32, bf16, fp16, auto"),
    ("train.ddp.grad_reduce", "fp32, bf16"),
    ("logger.backend", "wandb, none"),
    ("logger.wandb.mode", "offline, online, disabled"),
])
def test_every_enumerated_setting_refuses_a_bad_value_and_lists_the_choices(key, choices):
    with pytest.raises(ConfigCompositionException) as err:
        compose([f"{key}=bogus"])
    text = str(err.value.__cause__ or err.value)
    assert "Invalid value 'bogus'" in text and f"expected one of [{choices}]" in text, text


@pytest.mark.fast
def test_a_typo_or_a_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as typo:
        compose(["train.epochz=3"])
    assert "Key 'epochz' not in 'TrainLoopConfig'" in str(typo.value.__cause__)
    with pytest.raises(ConfigCompositionException) as wrong_type:
        compose(["train.epochs=many"])
    assert isinstance(wrong_type.value.__cause__, ValidationError)
    assert "train.epochs" in str(wrong_type.value.__cause__)


@pytest.mark.fast
def test_ddp_settings_compose_with_any_recipe_and_are_typed():
    cfg = compose(["recipe=gpt2_small", "train.ddp.bucket_cap_mb=1.5", "train.ddp.grad_reduce=bf16",
                   "train.ddp.static_graph=true", "train.ddp.broadcast_buffers=false"])
    ddp = cfg.train.ddp
    assert (ddp.bucket_cap_mb, ddp.grad_reduce.value, ddp.static_graph, ddp.broadcast_buffers) == \
        (1.5, "bf16", True, False)
    assert cfg.train.precision.value == "bf16" and cfg.train.grad_clip == 1.0  # the recipe's train settings stay
    assert compose(["train.ddp.bucket_cap_mb=4"]).train.ddp.bucket_cap_mb == 4.0
    for bad, needle in (("train.ddp.bucket_cap_mb=big", "could not be converted to Float"),
                        ("train.ddp.bucket_size=4", "Key 'bucket_size' not in 'DDPConfig'")):
        with pytest.raises(ConfigCompositionException) as err:
            compose([bad])
        assert needle in str(err.value.__cause__ or err.value), err.value


@pytest.mark.fast
def test_components_are_swapped_by_target():
    cfg = compose(["recipe.optim._target_=torch.optim.AdamW", "~recipe.optim.momentum",
                   "recipe.schedule._target_=trainer.step.schedules.Cosine", "recipe.schedule.warmup_steps=5"])
    assert dict(cfg.recipe.optim) == {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.01}
    assert dict(cfg.recipe.schedule) == {"_target_": "trainer.step.schedules.Cosine", "_partial_": True, "warmup_steps": 5}


@pytest.mark.fast
def test_experiment_presets_override_groups():
    cfg = compose(["experiment=compare"])
    assert cfg.graph.mode.value == "full" and cfg.graph.compare
    debug = compose(["experiment=debug"])
    assert debug.recipe.data.source == "synthetic" and debug.train.max_steps == 20
    # Per-recipe settings of an experiment (conf/experiment_recipe/debug_<recipe>.yaml) come with it...
    gpt = compose(["experiment=debug", "recipe=gpt_tiny"])
    assert (gpt.recipe.model.n_layer, gpt.recipe.model.context, gpt.train.max_steps) == (2, 64, 20)
    # ...but not without the experiment, and the command line still wins.
    assert compose(["recipe=gpt_tiny"]).recipe.model.n_layer == 6
    assert compose(["experiment=debug", "recipe=gpt_tiny", "recipe.model.n_layer=3"]).recipe.model.n_layer == 3


def test_cfg_job_prints_the_resolved_config_and_refuses_bad_choices(out):
    done = launch(["recipe=mnist", "graph=eager", "train.epochs=3", "--cfg", "job"], out, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "epochs: 3" in done.stdout and "mode: eager" in done.stdout and "capture_error_mode: global" in done.stdout
    assert not Path(out).exists()  # printing the config trains nothing and writes nothing
    bad = launch(["graph.capture_error_mode=bogus", "device=tpu", "--cfg", "job"], out, timeout=60)
    assert bad.returncode == 2 and "Invalid value 'bogus'" in bad.stderr and "Traceback" not in bad.stderr
    assert not Path(out).exists()


@pytest.mark.fast
def test_only_what_the_user_typed_is_refused_as_a_setting_of_the_other_parallel_mode():
    # gpt_1b's own train.fsdp.init=meta is its preset for fsdp2: a user who switches to ddp is not refused for it
    import torch

    from conf.schema import keys_overridden
    from trainer.plan import plan_run
    from trainer.run.errors import ConfigError

    cfg = compose(["recipe=gpt_1b", "train.parallel=ddp"])
    assert cfg.train.fsdp.init.value == "meta" and keys_overridden(cfg) == {"train.parallel"}  # recipe=: a group
    assert not plan_run(cfg, torch.device("cpu"), 1).parallelism.sharded
    with pytest.raises(ConfigError, match=r"train.fsdp.init=meta is a setting of train.parallel=fsdp2, but this run "
                                          r"uses train.parallel=ddp: drop train.fsdp.init=meta from the overrides"):
        plan_run(compose(["recipe=gpt_1b", "train.parallel=ddp", "train.fsdp.init=meta"]), torch.device("cpu"), 1)
    assert keys_overridden(compose(["train.fsdp={init: meta}", "+recipe.model.width=3"])) == {
        "train.fsdp", "recipe.model.width"}


def test_a_recipe_built_for_fsdp2_trains_under_ddp_when_the_user_switches(out):
    # the command line as a user types it (train.py under @hydra.main), gpt_1b's body made small for a CPU
    done = launch(["recipe=gpt_1b", "train.parallel=ddp", "experiment=debug", "recipe.model.vocab=256",
                   "recipe.data.batch_size=2", "train.max_steps=2", "logger=none", "train.eval=false",
                   "train.progress=false"], out, timeout=180)
    assert done.returncode == 0, done.output[-3000:]
    assert done.results()["steps"] == 2
    config = (done.run_dir / "config.yaml").read_text()
    assert "parallel: ddp" in config and "blocks_used" not in config  # replicated, not sharded
