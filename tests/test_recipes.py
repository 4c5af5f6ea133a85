"""The CIFAR-10 ResNet-18 and tiny-GPT recipes, on CPU: what a user does with them and what they see.

Runs are real ``train.py`` processes (python or torchrun with gloo) on small synthetic data.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conf.schema import compose


TINY_GPT = ["recipe.model.n_layer=2", "recipe.model.n_head=2", "recipe.model.d_model=64", "recipe.model.context=64"]
DEBUG = ["experiment=debug", "logger=none", "train.progress=false"]


def composed(*overrides: str):
    return compose(overrides)


# ---- choosing a recipe ---------------------------------------------------------------

@pytest.mark.fast
def test_cifar10_resnet18_config_has_the_usual_cifar_settings():
    cfg = composed("recipe=cifar10_resnet18")
    r = cfg.recipe
    assert r.name == "cifar10_resnet18"
    assert r._target_ == "recipes.cifar10.build"
    assert (r.optim._target_, r.optim.lr, r.optim.momentum, r.optim.nesterov, r.optim.weight_decay) == \
        ("torch.optim.SGD", 0.1, 0.9, True, 5e-4)
    assert r.schedule._target_ == "trainer.step.schedules.Cosine" and r.schedule.warmup_steps > 0
    assert (r.data.batch_size, r.data.eval_batch_size) == (128, 1000)
    assert 0 < r.label_smoothing < 1
    assert cfg.train.epochs >= 20 and cfg.train.log_every == 50
    assert OmegaConf.to_container(r.model) == {}


@pytest.mark.fast
def test_gpt_tiny_config_has_the_model_and_optimizer_a_user_expects():
    cfg = composed("recipe=gpt_tiny")
    r = cfg.recipe
    assert OmegaConf.to_container(r.model) == {"n_layer": 6, "n_head": 6, "d_model": 384, "context": 256,
                                               "vocab": 256, "dropout": 0.0}
    assert r._target_ == "recipes.gpt.build"
    assert (r.optim._target_, r.optim.lr, list(r.optim.betas), r.optim.weight_decay) == \
        ("torch.optim.AdamW", 6e-4, [0.9, 0.95], 0.1)
    assert r.schedule._target_ == "trainer.step.schedules.Cosine" and r.schedule.warmup_steps > 0
    assert r.data.batch_size == 8 and r.data.path is None
    assert (cfg.train.precision.value, cfg.train.grad_clip, cfg.train.grad_accum) == ("bf16", 1.0, 1)
    assert cfg.train.epochs <= 2 and cfg.train.log_every == 50
    # A model setting is an ordinary override.
    assert composed("recipe=gpt_tiny", "recipe.model.n_layer=2").recipe.model.n_layer == 2


# ---- training under torchrun ---------------------------------------------------------

# gpt_tiny under two ranks, DDP and fsdp2, with these checks: tests/test_fsdp_training.py.
def test_two_ranks_train_cifar_and_write_results(two_ranks_on_cifar):
    done = two_ranks_on_cifar  # tests/conftest.py: one epoch of 4 steps, read by test_ddp_settings too
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["recipe"] == "cifar10_resnet18" and res["world_size"] == 2 and res["data_source"] == "synthetic"
    assert res["steps"] == 4  # 128 samples, 2 ranks of 16
    assert math.isfinite(res["final/loss"]) and math.isfinite(res["final/eval_loss"])
    assert res["perf/samples_per_s"] > 0 and "perf/mfu_pct" not in res  # MFU only on a GPU with a known peak
    assert len(set(res["param_digests"])) == 1, "DDP replicas differ after training"
    config = OmegaConf.load(done.run_dir / "config.yaml")
    assert config.recipe.name == "cifar10_resnet18" and config.recipe.data.source_used == "synthetic"


@pytest.mark.fast
def test_gpt_trains_alike_from_device_and_host_loaders_and_evaluates_every_token(train_here, out):
    args = ["recipe=gpt_tiny", *DEBUG, *TINY_GPT, "train.precision=fp32", "recipe.data.train_size=64",
            "recipe.data.test_size=10", "recipe.data.batch_size=4", "recipe.data.eval_batch_size=4",
            "train.grad_accum=2", "train.max_steps=3"]
    device = train_here([*args, "recipe.data.loader=device"], out / "device")
    host = train_here([*args, "recipe.data.loader=host"], out / "host")
    for done in (device, host):
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.results()["final/eval_tokens"] == 10 * 64  # 10 windows of 64 tokens; padded rows masked
        assert "(640 tokens)" in done.stdout  # the epoch line counts in the recipe's unit
    for key in ("final/loss", "final/eval_loss"):
        assert host.results()[key] == pytest.approx(device.results()[key], rel=1e-5)


# ---- the synthetic stand-ins are learnable -------------------------------------------

def test_gpt_learns_the_synthetic_language_well_below_chance(train_here):
    # Chance is ln(256) = 5.55 nats per byte and letter frequencies alone give about 3.0:
    # going clearly below that means the model has learned spelling and word order.
    # (Measured: 2.30 after 120 steps; 0.53 after 600 steps of a slightly larger run.)
    done = train_here(["recipe=gpt_tiny", *DEBUG, "recipe.model.n_layer=2", "recipe.model.n_head=4",
                       "recipe.model.d_model=128", "recipe.model.context=64", "train.precision=fp32",
                       "recipe.data.train_size=4096", "recipe.data.test_size=32", "recipe.data.batch_size=16",
                       "recipe.data.eval_batch_size=32", "train.max_steps=120", "train.log_every=20",
                       "recipe.optim.lr=2e-3", "recipe.schedule.warmup_steps=10"])
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    losses = [round(m["train/loss"], 3) for m in done.metrics() if "train/loss" in m]
    assert losses[0] > 3.5 and res["final/loss"] < 2.6 and res["final/eval_loss"] < 2.6, losses


@pytest.mark.fast
def test_synthetic_cifar10_is_deterministic_and_learnable():
    from recipes.cifar10 import synthetic_cifar10

    train, test = synthetic_cifar10(0, 5000, 1000)
    assert train.x.shape == (5000, 3, 32, 32) and train.x.dtype == torch.uint8
    assert train.y.dtype == torch.int64 and set(train.y.tolist()) == set(range(10))
    again, _ = synthetic_cifar10(0, 5000, 1000)
    other, _ = synthetic_cifar10(1, 5000, 1000)
    assert torch.equal(train.x, again.x) and torch.equal(train.y, again.y)
    assert not torch.equal(train.x, other.x)
    # Classes have structure: nearest class mean already beats chance (10%) by far.
    xs = train.x.flatten(1).float()
    means = torch.stack([xs[train.y == c].mean(0) for c in range(10)])
    predicted = torch.cdist(test.x.flatten(1).float(), means).argmin(1)
    assert (predicted == test.y).float().mean() > 0.5


@pytest.mark.fast
def test_synthetic_text_is_deterministic_and_structured():
    from recipes.gpt import synthetic_splits, synthetic_text

    text = synthetic_text(0, 100_000)
    assert len(text) == 100_000 and text == synthetic_text(0, 100_000) and text != synthetic_text(1, 100_000)
    assert set(text) <= set(b"abcdefghijklmnopqrstuvwxyz .\n")
    words = text.replace(b".", b" ").split()
    assert len(set(words)) < 500 < len(words)  # a small vocabulary, used over and over
    train, test = synthetic_splits(0, 16, 50, 5)
    assert train.x.shape == train.y.shape == (50, 16) and test.x.shape == (5, 16)
    assert train.y.dtype == torch.int64
    assert torch.equal(train.x[:, 1:].long(), train.y[:, :-1]) and torch.equal(train.x[1:, 0].long(), train.y[:-1, -1])


# ---- CIFAR augmentation on the device ------------------------------------------------

def _candidates(img: torch.Tensor):
    """Every 32×32 crop of ``img`` padded by 4, mirrored or not."""
    padded = torch.nn.functional.pad(img, (4, 4, 4, 4))
    for dy in range(9):
        for dx in range(9):
            crop = padded[:, dy:dy + 32, dx:dx + 32]
            yield crop
            yield crop.flip(-1)


@pytest.mark.fast
def test_cifar_preprocess_normalizes_and_augments_with_crops_and_flips():
    from recipes.cifar10 import MEAN, STD, make_preprocess, random_crop_flip, synthetic_cifar10

    train, _ = synthetic_cifar10(0, 64, 8)
    preprocess = make_preprocess(torch.device("cpu"))
    batch = {"x": train.x[:64], "y": train.y[:64]}

    evaluated = preprocess(batch, False)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    assert evaluated["x"].dtype == torch.float32 and evaluated["x"].shape == (64, 3, 32, 32)
    torch.testing.assert_close(evaluated["x"], (train.x[:64].float() / 255 - mean) / std)
    assert evaluated["y"] is batch["y"]

    torch.manual_seed(0)
    augmented = preprocess(batch, True)["x"]
    torch.manual_seed(0)
    assert torch.equal(augmented, preprocess(batch, True)["x"]), "augmentation is not deterministic under a seed"
    assert augmented.shape == (64, 3, 32, 32)
    assert not torch.equal(augmented, preprocess(batch, True)["x"]), "a new step must draw new crops"
    changed = (augmented != evaluated["x"]).flatten(1).any(1)
    assert changed.float().mean() > 0.8

    # Each augmented image is exactly one padded crop of its source, mirrored or not;
    # over 64 images both mirror states and many offsets occur.
    torch.manual_seed(1)
    raw = train.x[:64].float()
    crops = random_crop_flip(raw)
    mirrored = 0
    for img, src in zip(crops, raw):
        matches = [i for i, c in enumerate(_candidates(src)) if torch.equal(c, img)]
        assert matches, "an augmented image is not a padded crop of its source"
        mirrored += all(i % 2 for i in matches)
    assert 10 < mirrored < 54


# ---- MFU ------------------------------------------------------------------------------

@pytest.mark.fast
def test_mfu_uses_the_dense_datasheet_peak_of_the_gpu_and_precision():
    from recipes.gpt import GPT, GPTConfig
    from trainer.metrics.perf import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == ("H100 SXM bf16 dense", 989.0)
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == ("H100 PCIe bf16 dense", 756.0)
    assert peak_tflops("NVIDIA H200", "bf16") == ("H200 SXM bf16 dense", 989.0)
    assert peak_tflops("NVIDIA H200", "fp32") == ("H200 SXM tf32 dense", 494.5)
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == ("A100 bf16 dense", 312.0)
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None  # not listed: no MFU rather than a wrong one
    # The default GPT: about 10.8 M parameters; 6 FLOPs per parameter and token, plus attention.
    model = GPT(GPTConfig())
    n = sum(p.numel() for p in model.parameters()) - 256 * 384  # without the position embedding
    assert model.training_flops_per_token() == 6 * n + 12 * 6 * 384 * 256


# ---- bad model settings --------------------------------------------------------------

@pytest.mark.fast
def test_unknown_gpt_model_key_is_named_once_in_one_process(train_here):
    one = train_here(["recipe=gpt_tiny", *DEBUG, "+recipe.model.n_layers=2"])
    assert one.returncode == 2, one.stderr[-3000:]
    assert one.stderr.count("recipe.model.n_layers") == 1 and "Traceback" not in one.stderr, one.stderr
    assert "recipe.model.n_layer," in one.stderr  # the message lists the settings that exist
    # Without the '+', Hydra itself refuses the unknown key and names it.
    with pytest.raises(ConfigCompositionException, match=r"n_layers"):
        composed("recipe=gpt_tiny", "recipe.model.n_layers=2")


@pytest.mark.fast
@pytest.mark.parametrize("recipe,override,named", [
    ("gpt_tiny", "recipe.model.n_head=5", "recipe.model.n_head"),  # 384 is not divisible by 5
    ("gpt_tiny", "recipe.model.dropout=1.5", "recipe.model.dropout"),
    ("gpt2_small", "recipe.model.vocab=0", "recipe.model.vocab"),
    ("gpt2_small", "recipe.model.layer_norm_bias=2", "recipe.model.layer_norm_bias"),
    ("gpt2_small", "recipe.data.source=webtext", "recipe.data.source"),
    ("cifar10_resnet18", "+recipe.model.width=32", "recipe.model"),
])
def test_bad_model_settings_fail_before_any_data_is_made(recipe, override, named):
    from trainer.run.errors import ConfigError
    from trainer.run.runtime import Runtime
    from trainer.plan import recipe_builder

    cfg = composed(f"recipe={recipe}", override)
    rt = Runtime(0, 0, 1, torch.device("cpu"), False, Path("."))
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        recipe_builder(cfg)(cfg, rt)


@pytest.mark.fast
def test_gpt_trains_on_a_text_file_given_by_path(tmp_path):
    from recipes.gpt import build
    from trainer.run.errors import ConfigError
    from trainer.run.runtime import Runtime

    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 100)  # 4500 bytes
    rt = Runtime(0, 0, 1, torch.device("cpu"), False, Path("."))
    recipe = build(composed("recipe=gpt_tiny", *TINY_GPT, f"recipe.data.path={text}"), rt)
    assert recipe.data.source == "text"
    assert recipe.data.train.x.shape == (4050 // 64, 64) and recipe.data.test.x.shape == (450 // 64, 64)
    assert bytes(recipe.data.train.x[0].tolist()) == text.read_bytes()[:64]
    assert recipe.unit == "tokens" and recipe.units_per_sample == 64 and recipe.flops_per_unit > 0
    for problem in (["recipe.data.source=text"],  # no path
                    [f"recipe.data.path={tmp_path / 'missing.txt'}"],
                    [f"recipe.data.path={text}", "recipe.model.context=512"]):  # too short for one test window
        with pytest.raises(ConfigError, match=r"recipe\.data\.path"):
            build(composed("recipe=gpt_tiny", *problem), rt)


@pytest.mark.parametrize("recipe", ["gpt_tiny", "cifar10_resnet18"])  # mnist's runs in many tests here
def test_the_debug_experiment_runs_each_recipe_in_seconds(train_here, recipe):
    """A benchmark the test run prints (not a timed assertion): the README says seconds. It runs in this
    process, so the number leaves out the start-up (imports) that a launch adds."""
    import time

    began = time.monotonic()
    done = train_here([f"recipe={recipe}", "experiment=debug", "logger=none"])
    print(f"experiment=debug recipe={recipe}: {time.monotonic() - began:.1f} s in this process")
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["steps"] == 20 and math.isfinite(res["final/eval_loss"])
    unit = "tokens" if recipe == "gpt_tiny" else "samples"
    assert f" {unit})" in done.stdout  # the epoch line counts in the recipe's own unit


def test_the_language_models_loss_and_top1_compiled_are_the_criterion_and_top1_apart():
    """next_token_loss_and_top1 as graph.compile_model runs it, through torch.compile (Inductor on the CPU here;
    the GPU test checks the CUDA kernels): the same correctness bit for bit, the loss and gradient to rounding."""
    from recipes.gpt import next_token_criterion, next_token_loss_and_top1
    from trainer.recipe import top1_correct

    torch.manual_seed(2)
    logits = torch.randn(2, 16, 64).bfloat16()
    labels = torch.randint(0, 64, (2, 16))
    labels[0, :6] = logits[0, :6].float().argmax(-1)
    labels[1, -3:] = -100
    apart, together = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = next_token_criterion(0.0)(apart, labels, reduction="mean")
    loss.backward()
    fused_loss, correct = torch.compile(next_token_loss_and_top1(0.0))(together, labels)
    fused_loss.backward()
    assert torch.equal(correct, top1_correct(logits, labels)) and 6 <= int(correct.sum()) < 29
    assert fused_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    assert torch.allclose(together.grad.float(), apart.grad.float(), atol=1e-5)
