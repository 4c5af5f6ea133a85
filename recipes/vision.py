"""Helpers shared by the image-classification recipes (mnist, cifar10_resnet18)."""
from __future__ import annotations

from typing import Callable, Tuple

import torch
import torch.nn.functional as F

from recipes.image_folder import folder_datasets
from recipes.subset import seeded_subset
from trainer.run.errors import ConfigError
from trainer.recipe import Datasets, Split
from trainer.run.runtime import Runtime
from trainer.data.sources import resolve_source


def classification_criterion(log_probs_given: bool, label_smoothing: float = 0.0):
    """The classifier's loss (of logits or log-probabilities), computed in fp32, with ``label_smoothing``
    (torch's: the target puts ``1 - label_smoothing`` on the label and spreads the rest evenly)."""

    def criterion(output: torch.Tensor, target: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        if log_probs_given and not label_smoothing:
            return F.nll_loss(output.float(), target, reduction=reduction)
        # log_softmax leaves log-probabilities as they are, so cross_entropy smooths them as it does logits
        return F.cross_entropy(output.float(), target, reduction=reduction, label_smoothing=label_smoothing)

    return criterion


def image_datasets(cfg, rt: Runtime, *, recipe: str, real_name: str, sizes: Tuple[int, int],
                   image_shape: Tuple[int, int, int], num_classes: int,
                   load_real: Callable[[str, bool], Tuple[Split, Split]],
                   make_synthetic: Callable[[int, int, int], Tuple[Split, Split]]) -> Datasets:
    """The data of a torchvision image recipe whose model takes no options.

    ``load_real(root, download)`` reads the real set; ``make_synthetic(seed, train_size,
    test_size)`` draws the stand-in, at the real set's ``sizes`` unless
    ``recipe.data.train_size``/``test_size`` say otherwise; of the real set they pick a seeded
    subset. ``source=folder`` reads images of ``image_shape`` (C, H, W) and at most
    ``num_classes`` classes from ``recipe.data.root`` (recipes/image_folder.py): images of any size
    become random-resized crops of ``image_shape`` (``recipe.data.crop_scale``,
    ``eval_resize_ratio``); train_size/test_size then pick a seeded subset too.
    """
    data_cfg = cfg.recipe.data
    if cfg.recipe.model:
        raise ConfigError(f"recipe.model has keys {sorted(cfg.recipe.model)} but the {recipe} model takes "
                          "none: remove them")
    if data_cfg.path is not None:
        raise ConfigError(f"recipe.data.path={data_cfg.path!r} is read by the text recipes only, and the {recipe} "
                          "recipe reads images: set recipe.data.path=null (images of your own: "
                          "recipe.data.source=folder recipe.data.root=<folder>)")
    for key, default in (("attention", "auto"), ("attention_kernel", "auto"), ("split_long_documents", True)):
        if data_cfg[key] != default:
            raise ConfigError(f"recipe.data.{key}={data_cfg[key]!r} is read by the language recipes only, and the "
                              f"{recipe} recipe reads images: remove it")
    if data_cfg.source == "folder":
        return folder_datasets(data_cfg.root, recipe=recipe, shape=image_shape, num_classes=num_classes,
                               seed=cfg.seed, train_size=data_cfg.train_size, test_size=data_cfg.test_size,
                               crop_scale=data_cfg.crop_scale, eval_resize_ratio=data_cfg.eval_resize_ratio)
    for key, default in (("crop_scale", None), ("eval_resize_ratio", 0.875)):
        if data_cfg[key] != default:
            raise ConfigError(f"recipe.data.{key}={data_cfg[key]} is read for image folders only "
                              f"(recipe.data.source=folder), and the {recipe} recipe reads {data_cfg.source} data: "
                              "remove it")
    train_size = data_cfg.train_size or sizes[0]
    test_size = data_cfg.test_size or sizes[1]
    data = resolve_source(
        rt, data_cfg.source, real_name, "recipe.data", handled_before=("folder",),
        load_real=lambda download: load_real(data_cfg.root, download),
        make_synthetic=lambda: make_synthetic(cfg.seed, train_size, test_size),
    )
    if data.source != real_name:
        return data
    return Datasets(*(seeded_subset(dataset, size, split=split, seed=cfg.seed, where=f"{real_name}'s {split} split")
                      for split, dataset, size in (("train", data.train, data_cfg.train_size),
                                                   ("test", data.test, data_cfg.test_size))), data.source)
