"""The arguments of the session's shared launches (conftest's fixtures), for a test that runs a variant of one."""
from __future__ import annotations

# Two gloo ranks, one epoch of cifar10_resnet18 (4 steps of 16 per rank) on synthetic images, with the default
# train.ddp settings: conftest's two_ranks_on_cifar, one launch, read by test_recipes and test_ddp_settings.
TWO_RANKS_ON_CIFAR = ["recipe=cifar10_resnet18", "recipe.data.source=synthetic", "recipe.data.train_size=128",
                      "recipe.data.batch_size=16", "recipe.data.test_size=64", "recipe.data.eval_batch_size=16",
                      "train.epochs=1", "train.log_every=2", "recipe.schedule.warmup_steps=2", "logger=none",
                      "train.progress=false"]
