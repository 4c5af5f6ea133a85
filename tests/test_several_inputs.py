"""A recipe whose model takes two inputs: tokens and an attention mask.

The user's dataset items are dicts ``{"x", "attention_mask", "y"}`` and the recipe's
``forward`` passes both to the model. The task can only be learned with the mask: the
label is the sign of the sum of the unmasked values, and the masked ones look alike, so
a model that saw ``x`` alone (or a mask from another row) stays near 75% accuracy. A
dataset item of another shape is named before any training, in one message.
"""
from __future__ import annotations

import os
import textwrap

import pytest
import torch

from helpers.availability import cuda_count
from helpers.launches import launch

RECIPE = '''
"""A user's recipe with two model inputs: the sign of the sum of the values the mask keeps."""
import torch
import torch.nn.functional as F

from trainer.recipe import Datasets, Recipe, top1_correct

LENGTH = 8


class MaskedSums(torch.utils.data.Dataset):
    """Item i: {"x": LENGTH values, "attention_mask": half of them kept, "y": sum of the kept > 0}."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, LENGTH, generator=g)
        self.mask = torch.rand(n, LENGTH, generator=g).argsort(dim=1) < LENGTH // 2
        self.y = (torch.where(self.mask, self.x, 0.0).sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "attention_mask": self.mask[i], "y": int(self.y[i])}


class WithTriples(MaskedSums):
    def __getitem__(self, i):  # the mask as a third value: not an item the trainer reads
        return self.x[i], self.mask[i], int(self.y[i])


class MaskedSum(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(LENGTH, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))

    def forward(self, x, attention_mask):
        return self.net(torch.where(attention_mask, x, 0.0))


def build(cfg, runtime, dataset=MaskedSums):
    torch.manual_seed(cfg.seed)
    return Recipe(name="masked_sum", model=MaskedSum(32),
                  data=Datasets(dataset(4096, cfg.seed), dataset(500, cfg.seed + 1), "masked_sums"),
                  preprocess=lambda batch, train: batch, criterion=F.cross_entropy, correct=top1_correct,
                  forward=lambda model, batch: model(batch["x"], batch["attention_mask"]))


def build_with_triples(cfg, runtime):
    return build(cfg, runtime, WithTriples)


def build_without_forward(cfg, runtime):  # the mask would never reach the model
    recipe = build(cfg, runtime)
    recipe.forward = None
    return recipe


def build_with_keywords(cfg, runtime):  # fine eagerly and in a whole-step graph; not for graph=partial
    recipe = build(cfg, runtime)
    recipe.forward = lambda model, batch: model(batch["x"], attention_mask=batch["attention_mask"])
    return recipe
'''

ARGS = ["recipe._target_=user_inputs.masked_sum.build", "recipe.name=masked_sum",
        "recipe.optim._target_=torch.optim.AdamW", "~recipe.optim.momentum", "recipe.optim.lr=0.01",
        "recipe.data.batch_size=64", "recipe.data.eval_batch_size=128", "train.epochs=3", "train.log_every=16",
        "logger=none"]


def write_package(root):
    (root / "user_inputs").mkdir(parents=True)
    (root / "user_inputs" / "__init__.py").write_text("")
    (root / "user_inputs" / "masked_sum.py").write_text(textwrap.dedent(RECIPE))
    return root


@pytest.fixture
def user_package(tmp_path):
    root = write_package(tmp_path / "site")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture
def importable(tmp_path, monkeypatch):
    """The package on this process's path (for in-process runs)."""
    monkeypatch.syspath_prepend(str(write_package(tmp_path / "here")))
    yield
    import sys
    for name in [n for n in sys.modules if n.startswith("user_inputs")]:
        del sys.modules[name]


def refused_once(train_here, builder: str, needle: str) -> str:
    """Trains with ``user_inputs.masked_sum.<builder>``: exit 2, ``needle`` said once, no traceback, no run
    directory left behind (a config error). Returns what was printed."""
    done = train_here([*ARGS, f"recipe._target_=user_inputs.masked_sum.{builder}"])
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert text.count(needle) == 1, text[-3000:]
    assert "Traceback" not in text
    assert not done.output_root.exists(), "a config error leaves no run directory behind"
    return text


def test_a_model_with_two_inputs_gets_both_under_two_gloo_ranks_through_host_workers(out, user_package):
    done = launch([*ARGS, "graph=eager", "recipe.data.loader=host", "recipe.data.num_workers=2"], out, nproc=2,
                  env=user_package, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["recipe"] == "masked_sum" and res["world_size"] == 2
    assert len(set(res["param_digests"])) == 1
    assert res["final/eval_samples"] == 500
    assert res["final/eval_accuracy"] > 0.95, res  # without its own row's mask a model stays near 0.75


@pytest.mark.fast
def test_the_device_loader_gives_the_model_both_inputs_too(train_here, importable):
    done = train_here([*ARGS, "recipe.data.loader=device"])
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["final/eval_accuracy"] > 0.95, res


@pytest.mark.fast
def test_a_dataset_item_of_three_values_is_named_once_before_training(train_here, importable):
    text = refused_once(train_here, "build_with_triples",
                        "recipe._target_=user_inputs.masked_sum.build_with_triples returned data the loaders cannot "
                        "read: in its train split, item 0 is a tuple of 3 values")
    assert 'a dict {"x": ..., "y": ..., <input name>: ...}' in text
    assert "unpack" not in text


@pytest.mark.fast
def test_inputs_no_forward_passes_on_are_refused_not_dropped(train_here, importable):
    refused_once(train_here, "build_without_forward",
                 "returned train data with the inputs 'attention_mask' besides 'x' and 'y', but no Recipe.forward to "
                 "pass them to the model")


@pytest.mark.fast
def test_partial_graphs_take_the_positional_tensors_forward_passes_and_refuse_keywords(importable):
    from conf.schema import compose
    from trainer.step.steps import positional_model_inputs
    from trainer.session import build_recipe_alone
    from trainer.run.errors import ConfigError
    from trainer.plan import plan_run

    plan = plan_run(compose([*ARGS]), torch.device("cpu"), world_size=1)
    recipe = build_recipe_alone(plan.cfg)
    batch = {"x": torch.randn(4, 8), "attention_mask": torch.rand(4, 8) > 0.5, "y": torch.zeros(4).long()}
    args = positional_model_inputs(recipe, plan.memory_format, recipe.model, batch, plan.cfg.recipe._target_)
    assert len(args) == 2 and args[0] is batch["x"] and args[1] is batch["attention_mask"]

    keywords = plan_run(compose([*ARGS, "recipe._target_=user_inputs.masked_sum.build_with_keywords"]),
                        torch.device("cpu"), world_size=1)
    recipe = build_recipe_alone(keywords.cfg)
    with pytest.raises(ConfigError) as err:
        positional_model_inputs(recipe, keywords.memory_format, recipe.model, batch,
                                keywords.cfg.recipe._target_)
    assert "graph.mode=partial" in str(err.value) and "keyword arguments (attention_mask)" in str(err.value)
    assert "recipe._target_=user_inputs.masked_sum.build_with_keywords" in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph", ["full", "partial", "compile"])
def test_a_model_with_two_inputs_trains_in_every_graph_mode(out, user_package, graph):
    done = launch([*ARGS, f"graph={graph}"], out, nproc=min(2, cuda_count()), env=user_package, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["mode"] == graph and res["final/eval_accuracy"] > 0.95, res
