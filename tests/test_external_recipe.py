"""A user brings their own recipe from their own package: ``recipe._target_=<their build>``.

The package lives outside this repo (a temporary directory on PYTHONPATH), is written
against the Recipe contract only (trainer/recipe.py), and trains under torchrun: with
two gloo ranks on the CPU, and on GPUs in every graph mode.
"""
from __future__ import annotations

import os
import textwrap

import pytest

from helpers.availability import cuda_count
from helpers.launches import launch

RECIPE = '''
"""A user's recipe: a two-layer MLP on 2-D points in concentric rings."""
import math

import torch
import torch.nn.functional as F

from trainer.recipe import Datasets, Recipe, Split, top1_correct


def rings(n, generator):
    label = torch.randint(0, 3, (n,), generator=generator)
    angle = torch.rand(n, generator=generator) * 2 * math.pi
    radius = 1.0 + label.float() + 0.15 * torch.randn(n, generator=generator)
    return Split(torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1), label)


def build(cfg, runtime):
    g = torch.Generator().manual_seed(cfg.seed)
    width = int(cfg.recipe.model.get("width", 32))
    model = torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))

    # torch's own loss is a criterion: it takes reduction="mean" in training, "none" in evaluation.
    return Recipe(name="rings", model=model, data=Datasets(rings(4096, g), rings(512, g), "rings"),
                  preprocess=lambda batch, train: batch, criterion=F.cross_entropy, correct=top1_correct)
'''

ARGS = ["recipe._target_=user_recipes.rings.build", "recipe.name=rings", "+recipe.model.width=64",
        "recipe.optim._target_=torch.optim.AdamW", "~recipe.optim.momentum", "recipe.optim.lr=0.01",
        "recipe.data.batch_size=64", "recipe.data.eval_batch_size=128", "train.epochs=3", "train.log_every=16",
        "logger=none"]


@pytest.fixture
def user_package(tmp_path):
    root = tmp_path / "site"
    (root / "user_recipes").mkdir(parents=True)
    (root / "user_recipes" / "__init__.py").write_text("")
    (root / "user_recipes" / "rings.py").write_text(textwrap.dedent(RECIPE))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}


def test_a_recipe_from_the_users_own_package_trains_under_two_gloo_ranks(out, user_package):
    done = launch([*ARGS, "graph=eager"], out, nproc=2, env=user_package, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["recipe"] == "rings" and res["data_source"] == "rings" and res["world_size"] == 2
    assert res["steps"] == 3 * (4096 // 2 // 64)
    assert len(set(res["param_digests"])) == 1
    assert res["final/eval_samples"] == 512
    assert res["final/eval_accuracy"] > 0.9, res  # chance is 1/3: the user's model really trained
    assert "rings" in done.run_dir.name


@pytest.mark.fast
def test_without_the_package_on_the_path_the_target_is_named(train_here):
    done = train_here([*ARGS, "graph=eager"])
    text = done.stdout + done.stderr
    assert done.returncode == 2
    assert text.count("recipe._target_=user_recipes.rings.build cannot be imported") == 1, text[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph", ["eager", "full", "full_compiled", "partial", "compile"])
def test_a_users_recipe_trains_in_every_graph_mode(out, user_package, graph):
    done = launch([*ARGS, f"graph={graph}"], out, nproc=min(2, cuda_count()), env=user_package, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["recipe"] == "rings" and res["mode"] == {"full_compiled": "full"}.get(graph, graph)
    assert len(set(res["param_digests"])) == 1
    assert res["final/eval_accuracy"] > 0.9, res
    if graph in ("full", "full_compiled"):
        assert res["timed_phase"] == "graph" and res["graph/train_capture_s"] > 0
