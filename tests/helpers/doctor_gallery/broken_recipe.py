"""A user's recipe whose loss reads a value on the host: scripts/doctor.py must name the line.

    python scripts/doctor.py recipe._target_=helpers.doctor_gallery.broken_recipe.build recipe.name=broken
    (with tests/ on PYTHONPATH)
"""
from __future__ import annotations

import torch.nn.functional as F

from recipes.mnist import Net, preprocess, synthetic_mnist
from trainer.recipe import Datasets, Recipe, top1_correct

WORST = [0.0]


def build(cfg, runtime):
    train, test = synthetic_mnist(cfg.seed, cfg.recipe.data.train_size or 512, cfg.recipe.data.test_size or 128)

    def criterion(output, target):
        per_sample = F.nll_loss(output, target, reduction="none")
        WORST[0] = max(WORST[0], per_sample.max().item())  # doctor: host_sync
        return per_sample

    return Recipe(name=cfg.recipe.name, model=Net(), data=Datasets(train, test, "synthetic"),
                  preprocess=preprocess, criterion=criterion, correct=top1_correct)
