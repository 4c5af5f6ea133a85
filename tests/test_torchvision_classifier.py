"""recipe=torchvision_classifier: any torchvision classification model by name, on the CPU here (on a GPU, from a
folder of mixed sizes, graphed against eager: tests/test_image_folder_gpu.py)."""
from __future__ import annotations

import pytest

SMALL = ["recipe=torchvision_classifier", "recipe.model.name=resnet18", "recipe.model.image_size=64",
         "recipe.data.train_size=64", "recipe.data.test_size=32", "recipe.data.batch_size=8",
         "recipe.data.eval_batch_size=16", "recipe.data.num_workers=0", "logger=none", "train.epochs=1"]


def test_a_resnet_trains_on_the_synthetic_stand_in_and_reports_its_flops(train_here):
    done = train_here([*SMALL, "train.max_steps=4", "train.log_every=2"])
    assert done.returncode == 0, done.stderr[-3000:]
    results = done.results()
    assert results["data_source"] == "synthetic" and results["final/eval_samples"] == 32
    losses = [m["train/loss"] for m in done.metrics() if "train/loss" in m]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


def test_a_vision_transformer_builds_at_the_size_asked_with_its_encoder_blocks_to_shard():
    from omegaconf import OmegaConf

    from conf.schema import compose
    from recipes.torchvision_classifier import build

    cfg = compose([*SMALL, "recipe.model.name=vit_b_16", "recipe.model.image_size=32"])
    OmegaConf.set_readonly(cfg, False)

    class Rt:
        device = __import__("torch").device("cpu")

    recipe = build(cfg, Rt())
    assert len(recipe.blocks) == 12 and type(recipe.blocks[0]).__name__ == "EncoderBlock"
    assert recipe.model.image_size == 32 and recipe.model.heads.head.out_features == 10
    assert recipe.flops_per_unit > 0


@pytest.mark.parametrize("size", [16, 32])
def test_a_resnet_builds_at_the_smallest_sizes_its_flops_counted(size):
    """At 32 pixels and under ResNet's last maps are 1x1: its FLOPs are counted on one image in eval mode (BatchNorm in
    training refuses a single value per channel)."""
    from omegaconf import OmegaConf

    from conf.schema import compose
    from recipes.torchvision_classifier import build

    cfg = compose([*SMALL, f"recipe.model.image_size={size}"])
    OmegaConf.set_readonly(cfg, False)

    class Rt:
        device = __import__("torch").device("cpu")

    recipe = build(cfg, Rt())
    assert recipe.flops_per_unit > 0 and recipe.model.training


@pytest.mark.parametrize("overrides,message", [
    (["recipe.model.name=resnet5"], "recipe.model.name='resnet5' is not a torchvision classification model: did "
                                    "you mean resnet50"),
    (["+recipe.model.depth=3"], "recipe.model.depth is not a setting of the torchvision classifier"),
    (["recipe.model.image_size=8"], "recipe.model.image_size=8 must be an integer of at least 16"),
    (["recipe.model.num_classes=1"], "recipe.model.num_classes=1 must be an integer of at least 2"),
    (["recipe.data.source=mnist"], "recipe.data.source='mnist' is not one of auto, folder, synthetic"),
])
def test_a_bad_model_or_source_is_refused_naming_the_setting(train_here, overrides, message):
    done = train_here([*SMALL, *overrides])
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr


def test_two_gloo_ranks_train_a_resnet_sharded_with_fsdp2_as_with_ddp(tmp_path):
    """train.parallel=fsdp2 shards the model's residual blocks (Recipe.blocks); in fp32 its steps equal DDP's."""
    from helpers.launches import launch_together

    args = [*SMALL, "recipe.model.image_size=32", "train.max_steps=4", "train.log_every=2", "train.precision=fp32",
            "train.progress=false"]
    runs = launch_together({p: [*args, f"train.parallel={p}"] for p in ("ddp", "fsdp2")}, tmp_path, nproc=2,
                           timeout=240)
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    ddp, fsdp2 = (runs[p].results() for p in ("ddp", "fsdp2"))
    assert ddp["world_size"] == fsdp2["world_size"] == 2
    for key in ("final/loss", "final/eval_loss"):
        assert fsdp2[key] == pytest.approx(ddp[key], rel=1e-5), key
