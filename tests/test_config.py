"""A user lists conf/, picks groups and overrides values: every combination composes."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from conf.schema import GraphMode, register_configs
from conftest import ROOT, launch

CONF = ROOT / "conf"


def options(group: str):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def composer():
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda overrides: compose(config_name="train", overrides=overrides)
    GlobalHydra.instance().clear()


def test_every_group_combination_composes(composer):
    combos = list(itertools.product(options("recipe"), options("graph"), options("logger"),
                                    [None, *options("experiment")]))
    assert len(combos) >= 1 * 6 * 2 * 3
    for recipe, graph, logger, experiment in combos:
        overrides = [f"recipe={recipe}", f"graph={graph}", f"logger={logger}"]
        if experiment:
            overrides.append(f"experiment={experiment}")
        cfg = composer(overrides)
        assert cfg.recipe.name == recipe
        assert isinstance(cfg.graph.mode, GraphMode)
        assert cfg.logger.backend.value == logger
        assert cfg.recipe.data.batch_size >= 1


def test_defaults_are_the_readme_defaults(composer):
    cfg = composer([])
    assert cfg.recipe.name == "mnist"
    assert cfg.graph.mode == GraphMode.auto and cfg.graph.warmup_iters == 11
    assert cfg.graph.capture_error_mode == "global"
    assert cfg.recipe.data.source == "auto" and cfg.recipe.data.batch_size == 64
    assert cfg.recipe.optim.name == "sgd" and cfg.recipe.optim.lr == 0.01 and cfg.recipe.optim.momentum == 0.5
    assert cfg.train.epochs == 10
    assert cfg.logger.backend.value == "wandb" and cfg.logger.wandb.mode is None  # offline unless told


def test_a_typo_or_a_wrong_type_fails_at_compose_time(composer):
    with pytest.raises(ConfigCompositionException) as typo:
        composer(["train.epochz=3"])
    assert "Key 'epochz' not in 'TrainLoopConfig'" in str(typo.value.__cause__)
    with pytest.raises(ConfigCompositionException) as wrong_type:
        composer(["train.epochs=many"])
    assert isinstance(wrong_type.value.__cause__, ValidationError)
    with pytest.raises(ConfigCompositionException):
        composer(["graph.mode=fastest"])


def test_experiment_presets_override_groups(composer):
    cfg = composer(["experiment=compare"])
    assert cfg.graph.mode == GraphMode.full and cfg.graph.compare
    debug = composer(["experiment=debug"])
    assert debug.recipe.data.source == "synthetic" and debug.train.max_steps == 20


def test_cfg_job_prints_the_resolved_config(out):
    done = launch(["recipe=mnist", "graph=eager", "train.epochs=3", "--cfg", "job"], out, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "epochs: 3" in done.stdout and "mode: eager" in done.stdout and "capture_error_mode: global" in done.stdout
    assert not Path(out).exists()  # printing the config trains nothing and writes nothing
