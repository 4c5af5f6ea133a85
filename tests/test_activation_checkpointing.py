"""A user turns on train.activation_checkpointing, on CPU: the recipes that support it train as
without it (same loss, same gradients, the blocks recomputed in backward), and a recipe that
does not is refused with the setting named.

| what the user does                                          | what they see                          |
|-------------------------------------------------------------|----------------------------------------|
| train.activation_checkpointing=true with any recipe         | composes; off by default               |
| one step of gpt_tiny / cifar10_resnet18 with it on and off  | the same loss, gradients, BN stats     |
| recipe=mnist (or their own recipe that does not declare it) | exit 2, one message naming the setting |
| their own recipe that declares it                           | trains, config.yaml says it was used   |
| python train.py recipe=gpt_tiny with it on                  | trains, results written                |

GPU behaviour (inside a CUDA graph, dropout) is in tests/test_activation_checkpointing_gpu.py.
"""
from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conf.schema import compose
from test_external_recipe import ARGS as USER_RECIPE_ARGS, RECIPE as USER_RECIPE

SETTING = "train.activation_checkpointing"
QUICK = ["recipe.data.source=synthetic", "recipe.data.train_size=512", "recipe.data.test_size=64",
         "logger=none", "train.max_steps=2"]
TINY_GPT = ["recipe.model.n_layer=2", "recipe.model.n_head=2", "recipe.model.d_model=64", "recipe.model.context=32",
            "recipe.data.train_size=64", "recipe.data.test_size=16"]


# ---- the setting -----------------------------------------------------------------------

@pytest.mark.fast
@pytest.mark.parametrize("recipe", ["mnist", "cifar10_resnet18", "gpt_tiny", "gpt2_small"])
def test_the_setting_composes_with_every_recipe_and_is_off_by_default(recipe):
    assert compose([f"recipe={recipe}"]).train.activation_checkpointing is False
    assert compose([f"recipe={recipe}", f"{SETTING}=true"]).train.activation_checkpointing is True
    with pytest.raises(ConfigCompositionException) as err:
        compose([f"recipe={recipe}", f"{SETTING}=sometimes"])
    assert "activation_checkpointing" in str(err.value) + str(err.value.__cause__)


# ---- one training step, with and without -----------------------------------------------

def one_step(recipe_name: str, overrides, checkpointing: bool):
    """One forward and backward of the recipe's model, built by its build() as a run would, on the
    first 8 training samples: (loss, gradients, buffers, calls of the first block's forward)."""
    from trainer.session import build_recipe_alone

    cfg = compose([f"recipe={recipe_name}", "experiment=debug", "train.precision=fp32", *overrides,
                   f"{SETTING}={str(checkpointing).lower()}"])
    torch.manual_seed(0)  # the model's initialization: the same weights with and without
    recipe = build_recipe_alone(cfg)
    model = recipe.model.train()
    assert recipe.activation_checkpointing is checkpointing
    first_block = model.blocks[0] if recipe_name == "gpt_tiny" else model.layer1
    calls = []
    # A pre-hook: the recompute stops once backward has what it needs, before forward hooks would run.
    first_block.register_forward_pre_hook(lambda module, args: calls.append(1))
    split = recipe.data.train
    batch = recipe.preprocess({"x": split.x[:8], "y": split.y[:8]}, False)  # normalization only: no random crop
    torch.manual_seed(1)  # the dropout masks: the same draws with and without
    loss = recipe.criterion(model(batch["x"]), batch["y"], reduction="mean")
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return loss.detach(), grads, buffers, len(calls)


@pytest.mark.fast
@pytest.mark.parametrize("recipe,overrides", [
    ("gpt_tiny", [*TINY_GPT, "recipe.model.dropout=0.0"]),
    ("gpt_tiny", [*TINY_GPT, "recipe.model.dropout=0.1"]),  # the recompute replays the forward's dropout masks
    ("cifar10_resnet18", ["recipe.data.train_size=16", "recipe.data.test_size=8"]),  # BatchNorm in every stage
], ids=["gpt_tiny", "gpt_tiny-dropout", "cifar10_resnet18"])
def test_a_checkpointed_step_gives_the_loss_and_gradients_of_a_plain_one(recipe, overrides):
    loss, grads, buffers, calls = one_step(recipe, overrides, checkpointing=False)
    c_loss, c_grads, c_buffers, c_calls = one_step(recipe, overrides, checkpointing=True)
    assert (calls, c_calls) == (1, 2), "with checkpointing the block's forward runs again in backward"
    torch.testing.assert_close(c_loss, loss, rtol=0, atol=0)
    assert grads.keys() == c_grads.keys() and all(g is not None for g in c_grads.values())
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], rtol=1e-6, atol=1e-7, msg=f"gradient of {name}")
    # BatchNorm's running statistics (and its batch count) are updated once per step, not again in the recompute.
    for name in buffers:
        torch.testing.assert_close(c_buffers[name], buffers[name], rtol=0, atol=0, msg=f"buffer {name}")


@pytest.mark.fast
def test_evaluation_runs_the_blocks_plainly():
    from recipes.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, context=16), activation_checkpointing=True)
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    idx = torch.randint(0, 256, (2, 16))
    model.eval()
    model(idx).sum().backward()  # eval mode: no recompute even with grad on
    model.train()
    with torch.no_grad():
        model(idx)  # no grad: nothing to recompute for
    assert len(calls) == 2


# ---- a recipe that cannot: refused, never ignored ----------------------------------------

@pytest.mark.fast
def test_mnist_with_activation_checkpointing_is_refused_with_the_setting_named(train_here):
    done = train_here([*QUICK, f"{SETTING}=true"])
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert text.count(f"{SETTING}=true, but recipe 'mnist' (recipe._target_=recipes.mnist.build) neither applies "
                      "activation checkpointing") == 1, text[-3000:]
    assert f"Set {SETTING}=false" in text and "Recipe.blocks" in text
    assert "Recipe(..., activation_checkpointing=True)" in text
    assert "Traceback" not in text
    assert not done.output_root.exists(), "a config error leaves no run directory behind"


@pytest.fixture
def user_recipes(tmp_path, monkeypatch):
    """A user's package on sys.path, ``user_recipes``: rings.py (test_external_recipe's recipe, which
    says nothing about checkpointing) and checkpointed_rings.py (the same, declaring support)."""
    package = tmp_path / "site" / "user_recipes"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rings.py").write_text(textwrap.dedent(USER_RECIPE))
    (package / "checkpointed_rings.py").write_text(textwrap.dedent(CHECKPOINTED_USER_RECIPE))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield
    for name in [m for m in sys.modules if m == "user_recipes" or m.startswith("user_recipes.")]:
        del sys.modules[name]  # other tests expect the package not to be importable


CHECKPOINTED_USER_RECIPE = '''
"""A user's recipe whose model checkpoints its hidden block when asked to."""
import torch
import torch.nn.functional as F

from trainer.step.activation_checkpointing import checkpointed
from trainer.recipe import Datasets, Recipe, top1_correct
from user_recipes.rings import rings


class Net(torch.nn.Module):
    def __init__(self, width, activation_checkpointing):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(2, width), torch.nn.Linear(width, 3)
        self.hidden = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU())
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x):
        x = self.inp(x)
        x = checkpointed(self.hidden, x) if self.activation_checkpointing else self.hidden(x)
        return self.out(x)


def build(cfg, runtime):
    g = torch.Generator().manual_seed(cfg.seed)
    checkpointing = cfg.train.activation_checkpointing
    return Recipe(name="rings", model=Net(int(cfg.recipe.model.get("width", 32)), checkpointing),
                  data=Datasets(rings(4096, g), rings(512, g), "rings"), preprocess=lambda batch, train: batch,
                  criterion=F.cross_entropy, correct=top1_correct, activation_checkpointing=checkpointing)
'''


@pytest.mark.fast
def test_a_users_recipe_that_does_not_declare_it_is_refused(train_here, user_recipes):
    done = train_here([*USER_RECIPE_ARGS, "graph=eager", "train.max_steps=2", f"{SETTING}=true"])
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert text.count(f"{SETTING}=true, but recipe 'rings' (recipe._target_=user_recipes.rings.build)") == 1, text
    assert "Traceback" not in text and not done.output_root.exists()


@pytest.mark.fast
def test_a_users_recipe_that_declares_it_trains_with_it(train_here, user_recipes):
    args = [*USER_RECIPE_ARGS, "recipe._target_=user_recipes.checkpointed_rings.build", "graph=eager",
            "train.max_steps=6", "train.log_every=3"]
    with_it = train_here([*args, f"{SETTING}=true"])
    without = train_here([*args, f"{SETTING}=false"], with_it.output_root.parent / "without")
    for done in (with_it, without):
        assert done.returncode == 0, done.stderr[-3000:]
    used = OmegaConf.load(with_it.run_dir / "config.yaml").train
    assert used.activation_checkpointing and used.activation_checkpointing_used
    assert not OmegaConf.load(without.run_dir / "config.yaml").train.activation_checkpointing_used
    assert with_it.results()["final/loss"] == pytest.approx(without.results()["final/loss"], rel=1e-6)


# ---- train.py's run, as a user asks for it ----------------------------------------------

def test_train_py_trains_gpt_tiny_with_activation_checkpointing(train_here):
    done = train_here(["recipe=gpt_tiny", "experiment=debug", "logger=none", *TINY_GPT, "recipe.data.batch_size=4",
                       "recipe.data.eval_batch_size=8", "train.max_steps=6", "train.log_every=3", f"{SETTING}=true"])
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["recipe"] == "gpt_tiny" and res["steps"] == 6
    assert math.isfinite(res["final/loss"]) and math.isfinite(res["final/eval_loss"])
    used = OmegaConf.load(done.run_dir / "config.yaml").train
    assert used.activation_checkpointing and used.activation_checkpointing_used


# ---- scripts/bench_checkpointing.py, as far as a CPU goes (the numbers need a GPU) --------

def bracket(largest_that_fits, known, known_fits, granularity=8, start=None, trials_left=None):
    """scripts/bench_checkpointing.py's search against a device on which sizes up to
    ``largest_that_fits`` fit: (its answer, the sizes it tried)."""
    from scripts.bench_checkpointing import largest_fitting

    tried = []

    def fits(size):
        if trials_left is not None and len(tried) >= trials_left:
            return None  # out of time
        tried.append(size)
        return size <= largest_that_fits

    return largest_fitting(fits, known, known_fits, 256, granularity, start), tried


@pytest.mark.fast
def test_the_benchmark_brackets_the_largest_micro_batch_that_fits():
    # Doubling from the timed batch, then bisection to the granularity.
    assert bracket(100, 16, True) == ((96, 104, True), [32, 64, 128, 96, 112, 104])
    # Everything up to --max-batch fits: it says so and stops there.
    assert bracket(1000, 16, True) == ((256, None, True), [32, 64, 128, 256])
    # With checkpointing, the search starts where the one without stopped.
    assert bracket(100, 16, True, start=96) == ((96, 104, True), [96, 192, 144, 120, 104])
    # The timed batch itself does not fit: halving down first.
    assert bracket(10, 16, False) == ((8, 16, True), [8])
    assert bracket(10, 16, False, granularity=1) == ((10, 11, True), [8, 12, 10, 11])
    assert bracket(0, 4, False) == ((None, 1, True), [2, 1])
    # Out of time: what it knows so far, marked unfinished.
    assert bracket(100, 16, True, trials_left=2) == ((64, None, False), [32, 64])


@pytest.mark.fast
def test_the_benchmark_table_says_what_was_measured():
    from scripts.bench_checkpointing import markdown_table

    timed = {"fits": True, "mode": "full", "precision": "bf16", "unit": "tokens"}
    result = {"recipe": "gpt2_small", "device": "NVIDIA H200", "torch": "2.11.0", "batch_size": 16, "max_batch": 256,
              "settings": {
                  "off": {"timed": {**timed, "step_ms_median": 46.0, "step_ms_p90": 46.5, "tokens_per_s": 356173.9,
                                    "peak_allocated_mib": 20480.0},
                          "search": {"largest_fitting": 96, "smallest_failing": 104, "complete": True,
                                     "reached_max_batch": False}},
                  "on": {"timed": {**timed, "step_ms_median": 59.8, "step_ms_p90": 60.1, "tokens_per_s": 273980.0,
                                   "peak_allocated_mib": 10240.0},
                         "search": {"largest_fitting": 192, "smallest_failing": None, "complete": False,
                                    "reached_max_batch": False}}}}
    table = markdown_table(result)
    assert "| off | 46.00 | 46.50 | 356,174 | 20,480 | 96 (104 does not) |" in table
    assert "| on | 59.80 | 60.10 | 273,980 | 10,240 | 192 or more, search stopped by --time-budget |" in table
    assert "step time 1.30x, peak memory 0.50x at batch 16; largest micro-batch 2.00x" in table


def test_a_benchmark_trial_runs_in_its_own_process_and_reports_back(tmp_path):
    import argparse
    import time

    from scripts.bench_checkpointing import Bench

    cpu = ["recipe=gpt_tiny", "graph=eager", "device=cpu", "train.precision=fp32", *TINY_GPT]
    args = argparse.Namespace(overrides=cpu, train_options=[], time_budget=600.0, trial_timeout=120.0)
    bench = Bench(args, tmp_path, time.monotonic(), warmup_iters=3)
    outcome = bench.trial(True, 4, timed_steps=2)
    assert outcome["fits"] and outcome["activation_checkpointing_used"] and outcome["mode"] == "eager"
    assert outcome["step_ms_median"] > 0 and outcome["tokens_per_s"] > 0 and outcome["unit"] == "tokens"
    assert (outcome["batch_size"], outcome[SETTING]) == (4, True) and bench.trials == [outcome]


@pytest.mark.fast
def test_blocks_a_recipe_names_are_recomputed_in_backward_while_training_only():
    import torch

    from trainer.step.activation_checkpointing import checkpoint_blocks

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.calls = torch.nn.Linear(4, 4), 0

        def forward(self, x, scale=1.0):  # a keyword argument, as library blocks take them
            self.calls += 1
            return torch.tanh(self.linear(x)) * scale

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(Block(), Block())
    reference = [torch.nn.Linear(4, 4) for _ in range(2)]
    for ref, block in zip(reference, blocks):
        ref.load_state_dict(block.linear.state_dict())
    checkpoint_blocks(list(blocks))
    x = torch.randn(3, 4, requires_grad=True)
    out = blocks[1](blocks[0](x, scale=2.0))
    out.sum().backward()
    assert [b.calls for b in blocks] == [2, 2]  # the forward, and its recompute in backward
    expected = torch.tanh(reference[1](torch.tanh(reference[0](x)) * 2.0))
    torch.testing.assert_close(out, expected)
    assert list(blocks.state_dict()) == ["0.linear.weight", "0.linear.bias", "1.linear.weight", "1.linear.bias"]
    blocks.eval()
    with torch.no_grad():
        blocks[0](x)
    assert blocks[0].calls == 3  # evaluation runs plainly: once
