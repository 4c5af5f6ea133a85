"""MNIST: the PyTorch example network (two conv layers, dropout, two linear layers)."""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes.vision import classification_criterion, image_datasets
from trainer.recipe import Batch, Recipe, Split, top1_correct
from trainer.run.runtime import Runtime

MEAN, STD = 0.1307, 0.3081  # of the MNIST training set
TRAIN_SIZE, TEST_SIZE = 60_000, 10_000


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = self.fc2(self.dropout(x))
        return F.log_softmax(x, dim=1)


def synthetic_mnist(seed: int, train_size: int, test_size: int) -> Tuple[Split, Split]:
    """A learnable MNIST stand-in: 28×28 uint8 images, 10 classes.

    Each class is a smooth random stroke pattern; a sample is its class pattern,
    shifted by up to 2 pixels, rescaled in intensity and noised. Deterministic in
    ``seed``; train and test are drawn independently from the same classes.
    """
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(10, 1, 7, 7, generator=g)
    templates = F.interpolate(coarse, size=(24, 24), mode="bilinear", align_corners=False)
    templates = (templates - templates.mean(dim=(2, 3), keepdim=True)).clamp(min=0)
    templates = F.pad(templates / templates.amax(dim=(2, 3), keepdim=True), (2, 2, 2, 2))[:, 0]
    shifts = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)]
    shifted = torch.stack([torch.roll(templates, s, dims=(1, 2)) for s in shifts], dim=1)  # [10, 25, 28, 28]

    def draw(n: int, stream: int) -> Split:
        gs = torch.Generator().manual_seed(seed * 7919 + stream)
        y = torch.randint(0, 10, (n,), generator=gs)
        which = torch.randint(0, len(shifts), (n,), generator=gs)
        gain = 0.6 + 0.4 * torch.rand(n, 1, 1, generator=gs)
        # In place: 47 M floats for the training split, and start-up waits for them.
        img = shifted[y, which].mul_(gain).add_(torch.randn(n, 28, 28, generator=gs).mul_(0.35))
        x = img.clamp_(0, 1).mul_(255).round_().to(torch.uint8).unsqueeze(1)
        return Split(x, y)

    return draw(train_size, 1), draw(test_size, 2)


def load_torchvision_mnist(root: str, download: bool) -> Tuple[Split, Split]:
    from torchvision.datasets import MNIST

    def split(train: bool) -> Split:
        ds = MNIST(root=str(Path(root)), train=train, download=download)
        return Split(ds.data.unsqueeze(1).contiguous(), ds.targets.long())

    return split(True), split(False)


SHIFT = torch.tensor(-MEAN / STD)  # a CPU scalar: passed to the kernel as an argument, never copied


def preprocess(batch: Batch, train: bool) -> Batch:
    # (x / 255 - MEAN) / STD as one kernel, SHIFT + x / (255 STD): uint8 in, float32 out.
    return {**batch, "x": torch.add(SHIFT, batch["x"], alpha=1.0 / (255.0 * STD))}


def build(cfg, rt: Runtime) -> Recipe:
    data = image_datasets(cfg, rt, recipe="mnist", real_name="mnist", sizes=(TRAIN_SIZE, TEST_SIZE),
                          image_shape=(1, 28, 28), num_classes=10,
                          load_real=load_torchvision_mnist, make_synthetic=synthetic_mnist)
    smoothing = cfg.recipe.label_smoothing
    return Recipe(name=cfg.recipe.name, model=Net(), data=data, preprocess=preprocess,
                  criterion=classification_criterion(log_probs_given=True, label_smoothing=smoothing),
                  correct=top1_correct, label_smoothing=smoothing)
