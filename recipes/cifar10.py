"""CIFAR-10: torchvision's ResNet-18 adapted to 32×32 images, with crop and flip on the GPU.

The ImageNet stem (7×7 stride-2 conv, max-pool) would shrink a 32×32 image to 8×8
before the first block; the usual CIFAR variant uses a 3×3 stride-1 conv and no pool.
With ``train.activation_checkpointing=true`` each residual stage (layer1 to layer4) is
recomputed in backward while training.
Augmentation runs inside the step, on the device, from the default generator, so it
is captured into the CUDA graph and draws new crops and flips on every replay.
"""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes.vision import classification_criterion, image_datasets
from trainer.data.items import draws_per_epoch
from trainer.step.activation_checkpointing import checkpointed
from trainer.recipe import Batch, Recipe, Split, top1_correct
from trainer.run.runtime import Runtime

MEAN = (0.4914, 0.4822, 0.4465)  # per channel, of the CIFAR-10 training set
STD = (0.2470, 0.2435, 0.2616)
TRAIN_SIZE, TEST_SIZE = 50_000, 10_000
SIZE, PAD = 32, 4  # random crops of 32×32 from the image padded by 4 pixels


class ResNet18Cifar(nn.Module):
    """torchvision's ResNet-18 with the CIFAR stem; its parts keep torchvision's names (and
    initialization), so state dicts are torchvision's. ``activation_checkpointing``: each
    residual stage is recomputed in backward while training."""

    def __init__(self, activation_checkpointing: bool = False):
        super().__init__()
        from torchvision.models import resnet18

        base = resnet18(num_classes=10)
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1, self.relu = base.bn1, base.relu
        self.layer1, self.layer2, self.layer3, self.layer4 = base.layer1, base.layer2, base.layer3, base.layer4
        self.avgpool, self.fc = base.avgpool, base.fc
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = checkpointed(stage, x) if self.activation_checkpointing else stage(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def training_flops_per_sample(make_model) -> float:
    """3 × the forward FLOPs of one 32×32 image (backward ≈ 2 × forward), counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = make_model()
        x = torch.empty(1, 3, SIZE, SIZE)
    with FlopCounterMode(display=False) as counter:
        model(x)
    return 3.0 * counter.get_total_flops()


def synthetic_cifar10(seed: int, train_size: int, test_size: int) -> Tuple[Split, Split]:
    """A learnable CIFAR-10 stand-in: 3×32×32 uint8 images, 10 classes.

    Each class is a smooth random colour pattern; a sample is its class pattern,
    shifted by up to 3 pixels, mirrored half of the time, rescaled in intensity,
    tinted and noised. Deterministic in ``seed``; train and test are drawn
    independently from the same classes.
    """
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(10, 3, 6, 6, generator=g)
    templates = F.interpolate(coarse, size=(SIZE, SIZE), mode="bicubic", align_corners=False).clamp(0, 1)
    shifts = [(dy, dx) for dy in range(-3, 4) for dx in range(-3, 4)]
    variants = torch.stack([torch.roll(templates, s, dims=(2, 3)) for s in shifts], dim=1)  # [10, 49, 3, 32, 32]
    variants = torch.stack([variants, variants.flip(-1)], dim=2).reshape(-1, 3, SIZE, SIZE)  # class, shift, mirror

    def draw(n: int, stream: int) -> Split:
        gs = torch.Generator().manual_seed(seed * 7919 + stream)
        y = torch.randint(0, 10, (n,), generator=gs)
        variant = y * (2 * len(shifts)) + torch.randint(0, 2 * len(shifts), (n,), generator=gs)
        x = torch.empty(n, 3, SIZE, SIZE, dtype=torch.uint8)
        for lo in range(0, n, 4096):  # in chunks: the float images of 50k samples would need 600 MB
            hi = min(lo + 4096, n)
            img = variants.index_select(0, variant[lo:hi])
            img.mul_(0.5 + 0.5 * torch.rand(hi - lo, 1, 1, 1, generator=gs))  # brightness
            img.add_(0.15 * torch.randn(hi - lo, 3, 1, 1, generator=gs))  # colour tint
            img.add_(torch.rand(img.shape, generator=gs).sub_(0.5).mul_(0.6))  # uniform noise: faster than randn
            x[lo:hi] = img.clamp_(0, 1).mul_(255).round_()
        return Split(x, y)

    return draw(train_size, 1), draw(test_size, 2)


def load_torchvision_cifar10(root: str, download: bool) -> Tuple[Split, Split]:
    from torchvision.datasets import CIFAR10

    def split(train: bool) -> Split:
        ds = CIFAR10(root=str(Path(root)), train=train, download=download)
        x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # stored as [N, 32, 32, 3]
        return Split(x, torch.tensor(ds.targets, dtype=torch.long))

    return split(True), split(False)


def random_crop_flip(x: torch.Tensor, pad: int = PAD) -> torch.Tensor:
    """A random ``pad``-pixel-padded crop of each image, mirrored with probability 1/2.

    Graph-safe: static shapes, device-side randomness from the default generator, no
    host sync. One gather per axis picks each sample's rows and (possibly reversed) columns.
    """
    n, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n, 1), device=x.device)
    dx = torch.randint(0, 2 * pad + 1, (n, 1), device=x.device)
    flip = torch.randint(0, 2, (n, 1), device=x.device) == 1
    rows = dy + torch.arange(h, device=x.device)
    ramp = torch.arange(w, device=x.device)
    cols = dx + torch.where(flip, w - 1 - ramp, ramp)
    out = padded.gather(2, rows[:, None, :, None].expand(n, c, h, w + 2 * pad))
    return out.gather(3, cols[:, None, None, :].expand(n, c, h, w))


def make_preprocess(device: torch.device, crop: bool = True):
    # Normalization constants live on the device: building them inside the step would
    # copy from host memory on every call (and from a freed buffer on graph replay).
    scale = (1.0 / (255.0 * torch.tensor(STD))).view(1, 3, 1, 1).to(device)
    shift = (-torch.tensor(MEAN) / torch.tensor(STD)).view(1, 3, 1, 1).to(device)

    def preprocess(batch: Batch, train: bool) -> Batch:
        x = batch["x"].to(torch.float32)
        if train and crop:
            x = random_crop_flip(x)  # pads with black, as torchvision's RandomCrop does
        return {**batch, "x": x * scale + shift}

    return preprocess


def build(cfg, rt: Runtime) -> Recipe:
    data = image_datasets(cfg, rt, recipe="cifar10_resnet18", real_name="cifar10", sizes=(TRAIN_SIZE, TEST_SIZE),
                          image_shape=(3, SIZE, SIZE), num_classes=10,
                          load_real=load_torchvision_cifar10, make_synthetic=synthetic_cifar10)
    checkpointing, smoothing = cfg.train.activation_checkpointing, cfg.recipe.label_smoothing
    model = ResNet18Cifar(checkpointing)
    return Recipe(name=cfg.recipe.name, model=model, data=data,
                  # a folder cropped by its loader (random-resized crop and flip, recipes/image_crops.py) is not
                  # cropped again here
                  preprocess=make_preprocess(rt.device, crop=not draws_per_epoch(data.train)),
                  criterion=classification_criterion(log_probs_given=False, label_smoothing=smoothing),
                  correct=top1_correct, flops_per_unit=training_flops_per_sample(ResNet18Cifar),
                  activation_checkpointing=checkpointing, label_smoothing=smoothing,
                  blocks=[block for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for block in stage])
