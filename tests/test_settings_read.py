"""Every setting is read or refused: a setting that this run cannot carry stops it with one
message naming the key, before any step; none is trained without a word.

| setting                                              | what the user sees                            |
|------------------------------------------------------|-----------------------------------------------|
| recipe.label_smoothing, a recipe that does not apply | refused, naming it (mnist, cifar10, gpt apply) |
| recipe.optim._partial_ / recipe.schedule._partial_   | true (or none) works as in Hydra; else refused |
| recipe.data.path on an image recipe, or source!=text | refused                                       |
| recipe.data.train_size/test_size on real data        | a seeded subset, as of a folder               |
| train.loss_scale.* without train.precision=fp16      | refused                                       |
| graph.compare_steps without graph.compare=true       | refused                                       |
| conf/train.yaml                                      | holds no default: conf/schema.py has them     |
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from omegaconf import OmegaConf

from conf.schema import TrainConfig, compose
from helpers.paths import ROOT
from trainer.run.errors import ConfigError
from trainer.recipe import Datasets, Recipe, Split, top1_correct
from trainer.run.runtime import Runtime

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
QUICK = ["recipe.data.source=synthetic", "recipe.data.train_size=256", "recipe.data.test_size=64", "logger=none",
         "train.max_steps=2"]
RECIPE_ARGS = ["recipe.name=points", "recipe.optim._target_=torch.optim.AdamW", "~recipe.optim.momentum",
               "recipe.data.batch_size=16", "recipe.data.eval_batch_size=32", "logger=none", "train.max_steps=2"]


def rt() -> Runtime:
    return Runtime(0, 0, 1, CPU, False, Path("."))


def points(cfg, runtime, label_smoothing: float = 0.0) -> Recipe:
    """A user's recipe (``recipe._target_=test_settings_read.points``) whose loss has no label smoothing."""
    g = torch.Generator().manual_seed(cfg.seed)

    def split(n):
        x = torch.randn(n, 2, generator=g)
        return Split(x, (x[:, 0] > 0).long())

    return Recipe(name=cfg.recipe.name, model=torch.nn.Linear(2, 2), data=Datasets(split(256), split(64), "points"),
                  preprocess=lambda batch, train: batch, criterion=F.cross_entropy, correct=top1_correct,
                  label_smoothing=label_smoothing)


def smoothing_points(cfg, runtime) -> Recipe:
    """A user's recipe that applies label smoothing 0.2 whatever the setting says."""
    return points(cfg, runtime, label_smoothing=0.2)


def built(*overrides: str, target: str = "test_settings_read.points") -> Recipe:
    from trainer.plan import plan_run

    cfg = compose([f"recipe._target_={target}", "recipe.name=points", *overrides])
    return plan_run(cfg, CPU, 1).build_recipe(cfg, rt())


# ---- recipe.label_smoothing ------------------------------------------------------------

def test_label_smoothing_on_a_recipe_that_does_not_apply_it_is_refused_by_name(train_here):
    done = train_here([*RECIPE_ARGS, "recipe._target_=test_settings_read.points", "recipe.label_smoothing=0.1"])
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    needle = "recipe.label_smoothing=0.1: recipe 'points' (recipe._target_=test_settings_read.points) does not apply"
    assert text.count(needle) == 1, text[-3000:]
    assert "returning Recipe(..., label_smoothing=cfg.recipe.label_smoothing)" in text and "Traceback" not in text
    assert not done.output_root.exists(), "a config error leaves no run directory behind"


def test_a_recipe_says_which_label_smoothing_it_applies_and_must_apply_the_settings():
    assert built().label_smoothing == 0.0  # the setting off, the recipe without it: fine
    with pytest.raises(ConfigError, match=r"recipe\.label_smoothing=0: recipe 'points' .* applies 0\.2 instead"):
        built(target="test_settings_read.smoothing_points")
    assert built("recipe.label_smoothing=0.2", target="test_settings_read.smoothing_points").label_smoothing == 0.2
    for bad in ("1", "-0.1"):
        with pytest.raises(ConfigError, match=rf"recipe\.label_smoothing={bad}\.?0? must be at least 0 and below 1"):
            built(f"recipe.label_smoothing={bad}")


@pytest.mark.parametrize("recipe,extra", [
    ("mnist", []),
    ("cifar10_resnet18", []),
    ("gpt_tiny", ["recipe.model.n_layer=1", "recipe.model.d_model=32", "recipe.model.n_head=2",
                  "recipe.model.context=16"]),
])
def test_every_recipe_here_applies_label_smoothing(recipe, extra):
    from trainer.plan import plan_run

    cfg = compose([f"recipe={recipe}", "recipe.label_smoothing=0.3", "recipe.name=mine", *QUICK, *extra])
    built_recipe = plan_run(cfg, CPU, 1).build_recipe(cfg, rt())
    assert built_recipe.label_smoothing == 0.3
    assert built_recipe.name == "mine"  # recipe.name names results and checkpoints too
    x, y = built_recipe.data.train[0]
    output = built_recipe.model.eval()(built_recipe.preprocess({"x": x[None], "y": y[None]}, False)["x"])
    plain = compose([f"recipe={recipe}", "recipe.label_smoothing=0", *QUICK, *extra])
    unsmoothed = plan_run(plain, CPU, 1).build_recipe(plain, rt()).criterion
    assert not torch.allclose(built_recipe.criterion(output, y[None]), unsmoothed(output, y[None]))


def test_mnist_smooths_its_log_probabilities_as_cross_entropy_smooths_logits():
    from recipes.vision import classification_criterion

    logits, target, eps = torch.randn(6, 10), torch.randint(0, 10, (6,)), 0.1
    log_probs = F.log_softmax(logits, dim=1)  # what mnist's Net returns
    by_hand = (1 - eps) * F.nll_loss(log_probs, target, reduction="none") - eps * log_probs.mean(dim=1)
    smoothed = classification_criterion(log_probs_given=True, label_smoothing=eps)
    torch.testing.assert_close(smoothed(log_probs, target), by_hand)
    torch.testing.assert_close(smoothed(log_probs, target, reduction="mean"), by_hand.mean())
    torch.testing.assert_close(smoothed(log_probs, target),
                               F.cross_entropy(logits, target, reduction="none", label_smoothing=eps))
    plain = classification_criterion(log_probs_given=True)
    torch.testing.assert_close(plain(log_probs, target), F.nll_loss(log_probs, target, reduction="none"))


# ---- _partial_ ---------------------------------------------------------------------------

def test_optimizer_and_schedule_are_hydra_partials_that_the_trainer_completes():
    from hydra.utils import instantiate

    from trainer.step.optim import optimizer_spec, schedule_spec

    cfg = compose([])
    assert cfg.recipe.optim._partial_ is True and cfg.recipe.schedule._partial_ is True
    # As in lightning-hydra-template: your own loop can instantiate them and add what they lack.
    optimizer = instantiate(cfg.recipe.optim)(torch.nn.Linear(2, 2).parameters())
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.5
    assert instantiate(cfg.recipe.schedule)(base_lr=0.01, total_steps=10) is not None
    # The trainer completes them itself; without the key it does the same.
    assert optimizer_spec(cfg.recipe.optim).kwargs == {"momentum": 0.5}
    assert optimizer_spec({"_target_": "torch.optim.SGD", "lr": 0.1}).kwargs == {}
    assert schedule_spec({"_target_": "trainer.step.schedules.Constant"}).kwargs == {}


@pytest.mark.parametrize("override,needle", [
    ("recipe.optim._partial_=false", "recipe.optim._partial_=false: the trainer calls recipe.optim._target_ itself"),
    ("recipe.optim._partial_=yes", "recipe.optim._partial_='yes': the trainer calls recipe.optim._target_ itself"),
    ("recipe.schedule._partial_=false", "recipe.schedule._partial_=false: the trainer calls recipe.schedule._target_"),
])
def test_a_partial_other_than_true_is_refused_by_name(override, needle):
    from trainer.plan import plan_run

    with pytest.raises(ConfigError) as err:
        plan_run(compose([override]), CPU, 1)
    assert needle in str(err.value) and "(~recipe." in str(err.value)


# ---- recipe.data: path, train_size, test_size -------------------------------------------

def test_a_text_path_is_refused_where_nothing_reads_it(tmp_path):
    from recipes.gpt import build as build_gpt
    from recipes.mnist import build as build_mnist

    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 100)
    with pytest.raises(ConfigError, match=r"recipe\.data\.path='.*corpus\.txt' is read by the text recipes only"):
        build_mnist(compose(["recipe=mnist", *QUICK, f"recipe.data.path={text}"]), rt())
    for source in ("synthetic", "tokens"):
        with pytest.raises(ConfigError, match=rf"recipe\.data\.path=.* but recipe\.data\.source={source}: set"):
            build_gpt(compose(["recipe=gpt_tiny", f"recipe.data.source={source}", f"recipe.data.path={text}"]), rt())


def test_sizes_of_real_data_take_a_seeded_subset(tmp_path):
    from recipes.gpt import build as build_gpt
    from recipes.mnist import synthetic_mnist
    from recipes.vision import image_datasets

    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 100)  # 63 training windows of 64
    args = ["recipe=gpt_tiny", "recipe.model.n_layer=1", "recipe.model.d_model=32", "recipe.model.n_head=2",
            "recipe.model.context=64", f"recipe.data.path={text}"]
    whole = build_gpt(compose(args), rt()).data
    part = build_gpt(compose([*args, "recipe.data.train_size=10", "recipe.data.test_size=3"]), rt()).data
    assert (len(whole.train), len(part.train), len(part.test)) == (63, 10, 3) and part.source == "text"
    again = build_gpt(compose([*args, "recipe.data.train_size=10", "recipe.data.test_size=3"]), rt()).data
    assert torch.equal(part.train.x, again.train.x)  # seeded: every rank, every run draws the same
    with pytest.raises(ConfigError, match=r"recipe\.data\.train_size=64 but the train split of recipe\.data\.path="
                                          r".* has 63 samples: set recipe\.data\.train_size between 1 and 63"):
        build_gpt(compose([*args, "recipe.data.train_size=64"]), rt())

    # An image recipe's real set (here a stand-in that plays it) is cut the same way.
    def datasets(*overrides):
        return image_datasets(compose(["recipe=mnist", "recipe.data.source=mnist", *overrides]), rt(),
                              recipe="mnist", real_name="mnist", sizes=(100, 40), image_shape=(1, 28, 28),
                              num_classes=10, load_real=lambda root, download: synthetic_mnist(0, 100, 40),
                              make_synthetic=lambda: pytest.fail("the real set is there"))
    assert (len(datasets().train), len(datasets().test)) == (100, 40)
    real = datasets("recipe.data.train_size=30", "recipe.data.test_size=5")
    assert (len(real.train), len(real.test), real.source) == (30, 5, "mnist")


# ---- settings of another mode ------------------------------------------------------------

def test_settings_of_a_mode_this_run_is_not_in_are_refused():
    from trainer.plan import plan_run

    with pytest.raises(ConfigError, match=r"train\.loss_scale\.growth_interval=7 applies to train\.precision=fp16 "
                                          r"only, but this run trains in fp32 \(train\.precision=auto\)"):
        plan_run(compose(["train.precision=auto", "train.loss_scale.growth_interval=7"]), CPU, 1)
    with pytest.raises(ConfigError, match=r"train\.loss_scale\.init=1024 applies to train\.precision=fp16 only"):
        plan_run(compose(["train.loss_scale.init=1024"]), CPU, 1)
    with pytest.raises(ConfigError, match=r"graph\.compare_steps=50 is read only with graph\.compare=true"):
        plan_run(compose(["graph.compare_steps=50"]), CPU, 1)
    assert plan_run(compose([]), CPU, 1).precision == "fp32"  # the defaults themselves are never refused


# ---- defaults in one place ----------------------------------------------------------------

def test_train_yaml_holds_the_defaults_list_and_hydras_settings_only():
    entry = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())
    assert set(entry) == {"defaults", "hydra"}, "a default belongs in conf/schema.py, once"
    # A group file sets what its choice changes; the rest of its section is the schema's.
    schema = OmegaConf.structured(TrainConfig)
    for group in ("graph", "logger"):
        for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
            chosen = OmegaConf.load(path)
            choice_key = {"graph": "mode", "logger": "backend"}[group]
            for key, value in OmegaConf.to_container(chosen).items():
                if key != choice_key:
                    assert value != OmegaConf.to_container(schema[group])[key], f"{path.name} restates {key}"


# ---- graphing: a field nobody read ----------------------------------------------------------

def test_execution_report_compile_model_is_deprecated_and_warns_once(monkeypatch):
    import warnings

    from graphing import ExecutionReport, deprecation

    monkeypatch.setattr(deprecation, "_warned", set())
    report = ExecutionReport(mode="full")
    assert "compile_model" not in repr(report) and "compile_model" not in str(report.as_results())
    with pytest.warns(DeprecationWarning, match=r"ExecutionReport\.compile_model is deprecated: use the executor's "
                                                r"options\.compile_model"):
        assert report.compile_model is False
    report._compile_model = True  # as graphing/full.py records it under compile_model=True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second read is silent
        assert report.compile_model is True
