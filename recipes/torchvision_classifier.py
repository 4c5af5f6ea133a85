"""Any torchvision classification model by name (resnet50, vit_b_16, convnext_tiny, ...) on an image folder.

    python train.py recipe=torchvision_classifier recipe.data.root=/data/imagenet            # resnet50, 224
    python train.py recipe=torchvision_classifier recipe.model.name=vit_b_16 recipe.data.root=DIR

The model (``recipe.model``): ``name`` (any of ``torchvision.models.list_models(torchvision.models)``), built with
random weights (nothing is downloaded) for ``num_classes`` classes (null: the folder's), taking
``image_size`` x ``image_size`` RGB images (224: what the references train at).

Data (``recipe.data.source``): ``folder``: ``recipe.data.root/train/<class>/`` and ``test/`` (or ``val/``), images
of any size, random-resized crops to train and a resize + center crop to evaluate (recipes/image_folder.py;
scripts/make_image_folder.py writes such a folder); ``synthetic``: a learnable stand-in (smooth colour patterns per
class, shifted, mirrored, tinted and noised) at the model's size, held on the device; ``auto``: the folder when
``root/train`` exists, else synthetic. Inside the step, on the device: the horizontal flip of the synthetic set (the
folder's flip is drawn with its crop), and the ImageNet normalization.

Defaults follow torchvision's references/classification (ResNet-50: SGD 0.1 for 256 images a step, momentum 0.9,
weight decay 1e-4, 90 epochs), with three differences said in conf/recipe/torchvision_classifier.yaml: a cosine
schedule with 5 warm-up epochs' worth of steps in place of StepLR (this repo's schedules run on the device, inside
the graph; the references' newer recipes use cosine too), bf16 autocast on GPUs (their ``--amp``) and channels_last
(they have no such option).
"""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

import torch
import torch.nn.functional as F

from recipes.image_folder import folder_datasets
from recipes.vision import classification_criterion
from trainer.recipe import Batch, Datasets, Recipe, Split, blocks_named, top1_correct
from trainer.run.errors import ConfigError
from trainer.run.runtime import Runtime

MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as the references normalize
STD = (0.229, 0.224, 0.225)
MODEL_KEYS = ("name", "num_classes", "image_size")
SOURCES = ("auto", "folder", "synthetic")
SYNTHETIC_CLASSES, SYNTHETIC_SIZES = 10, (2560, 512)
MAX_FOLDER_CLASSES = 100_000  # the model's head is sized to the folder's classes: any number
# The repeated blocks of torchvision's classification families: what train.parallel=fsdp2 shards one by one.
BLOCK_CLASSES = ("BasicBlock", "Bottleneck", "EncoderBlock", "CNBlock", "MBConv", "FusedMBConv", "InvertedResidual",
                 "SwinTransformerBlock", "SwinTransformerBlockV2", "ResBottleneckBlock", "MaxVitBlock", "_DenseBlock")


def model_settings(settings) -> Tuple[str, object, int]:
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(MODEL_KEYS))
    if unknown:
        raise ConfigError(f"recipe.model.{unknown[0]} is not a setting of the torchvision classifier: use "
                          f"{', '.join('recipe.model.' + k for k in MODEL_KEYS)}")
    name, num_classes, size = settings.get("name", "resnet50"), settings.get("num_classes"), settings.get("image_size",
                                                                                                          224)
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if name not in known:
        import difflib

        near = difflib.get_close_matches(str(name), known, n=3)
        raise ConfigError(f"recipe.model.name={name!r} is not a torchvision classification model"
                          + (f": did you mean {', '.join(near)}?" if near else f" (one of {', '.join(known[:8])}, ...)"))
    if not isinstance(size, int) or size < 16:
        raise ConfigError(f"recipe.model.image_size={size!r} must be an integer of at least 16 (pixels a side)")
    if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 2):
        raise ConfigError(f"recipe.model.num_classes={num_classes!r} must be an integer of at least 2, or null for "
                          "the folder's classes")
    return name, num_classes, size


def synthetic_images(seed: int, size: int, train_size: int, test_size: int,
                     classes: int = SYNTHETIC_CLASSES) -> Tuple[Split, Split]:
    """A learnable stand-in at ``size`` x ``size``: each class a smooth random colour pattern; a sample is its
    pattern shifted, mirrored half the time, brightened or darkened, tinted and noised (uint8 [3, size, size])."""
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.rand(classes, 3, 6, 6, generator=g), size=(size, size), mode="bicubic",
                              align_corners=False).clamp(0, 1)

    def draw(n: int, stream: int) -> Split:
        gs = torch.Generator().manual_seed(seed * 7919 + stream)
        y = torch.randint(0, classes, (n,), generator=gs)
        x = torch.empty(n, 3, size, size, dtype=torch.uint8)
        shift = max(1, size // 10)
        for lo in range(0, n, 256):
            hi = min(lo + 256, n)
            img = templates.index_select(0, y[lo:hi])
            dy, dx = (int(v) for v in torch.randint(-shift, shift + 1, (2,), generator=gs))
            img = torch.roll(img, (dy, dx), dims=(2, 3))
            flip = torch.rand(hi - lo, generator=gs) < 0.5
            img = torch.where(flip[:, None, None, None], img.flip(-1), img)
            img = img * (0.5 + 0.5 * torch.rand(hi - lo, 1, 1, 1, generator=gs))
            img = img + 0.15 * torch.randn(hi - lo, 3, 1, 1, generator=gs)
            img = img + (torch.rand(img.shape, generator=gs) - 0.5) * 0.6
            x[lo:hi] = img.clamp(0, 1).mul(255).round()
        return Split(x, y)

    return draw(train_size, 1), draw(test_size, 2)


def datasets(cfg, size: int) -> Datasets:
    data_cfg = cfg.recipe.data
    source = data_cfg.source
    if source not in SOURCES:
        raise ConfigError(f"recipe.data.source={source!r} is not one of {', '.join(SOURCES)} for "
                          "recipe=torchvision_classifier: set recipe.data.source=folder (your images) or synthetic")
    if source == "auto":
        source = "folder" if (Path(data_cfg.root).expanduser() / "train").is_dir() else "synthetic"
    if source == "folder":
        return folder_datasets(data_cfg.root, recipe=cfg.recipe.name, shape=(3, size, size),
                               num_classes=cfg.recipe.model.get("num_classes") or MAX_FOLDER_CLASSES,
                               seed=cfg.seed, train_size=data_cfg.train_size, test_size=data_cfg.test_size,
                               crop_scale=data_cfg.crop_scale, eval_resize_ratio=data_cfg.eval_resize_ratio)
    for key, default in (("crop_scale", None), ("eval_resize_ratio", 0.875)):
        if data_cfg[key] != default:
            raise ConfigError(f"recipe.data.{key}={data_cfg[key]} is read for image folders only "
                              "(recipe.data.source=folder), and this run draws the synthetic stand-in: remove it")
    train, test = synthetic_images(cfg.seed, size, data_cfg.train_size or SYNTHETIC_SIZES[0],
                                   data_cfg.test_size or SYNTHETIC_SIZES[1])
    return Datasets(train, test, "synthetic")


def class_count(data: Datasets) -> int:
    classes = getattr(data.train, "classes", None) or getattr(getattr(data.train, "dataset", None), "classes", None)
    return len(classes) if classes else SYNTHETIC_CLASSES


def make_preprocess(device: torch.device, flip: bool):
    scale = (1.0 / (255.0 * torch.tensor(STD))).view(1, 3, 1, 1).to(device)  # on the device once: graph-safe
    shift = (-torch.tensor(MEAN) / torch.tensor(STD)).view(1, 3, 1, 1).to(device)

    def preprocess(batch: Batch, train: bool) -> Batch:
        x = batch["x"].to(torch.float32)
        if train and flip:  # device-side randomness from the default generator: a new draw on every replay
            mirrored = torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5
            x = torch.where(mirrored, x.flip(-1), x)
        return {**batch, "x": x * scale + shift}

    return preprocess


def training_flops_per_sample(name: str, num_classes: int, size: int, **sized) -> float:
    """3 x the forward FLOPs of one image (backward about 2 x forward), counted on the meta device."""
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):  # in eval mode: BatchNorm refuses one image of 1x1 maps in training (32 pixels)
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **sized).eval()
        x = torch.empty(1, 3, size, size)
    with FlopCounterMode(display=False) as counter:
        model(x)
    return 3.0 * counter.get_total_flops()


def build(cfg, rt: Runtime) -> Recipe:
    import torchvision

    name, num_classes, size = model_settings(cfg.recipe.model)
    data = datasets(cfg, size)
    classes = num_classes or class_count(data)
    sized = {"image_size": size} if name.startswith("vit_") else {}  # a ViT's position table is sized for it
    try:
        model = torchvision.models.get_model(name, weights=None, num_classes=classes, **sized)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"recipe.model.name={name} cannot be built at recipe.model.image_size={size} "
                          f"({e}): use image_size=224") from None
    smoothing = cfg.recipe.label_smoothing
    return Recipe(name=cfg.recipe.name, model=model, data=data,
                  preprocess=make_preprocess(rt.device, flip=data.source == "synthetic"),
                  criterion=classification_criterion(log_probs_given=False, label_smoothing=smoothing),
                  correct=top1_correct, flops_per_unit=training_flops_per_sample(name, classes, size, **sized),
                  label_smoothing=smoothing, blocks=blocks_named(model, BLOCK_CLASSES))
