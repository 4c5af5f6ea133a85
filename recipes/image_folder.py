"""Images from a folder laid out as torchvision's ImageFolder, for the image recipes.

    DIR/train/<class>/*.png      (or .jpg/.jpeg; classes: the sorted subfolder names of train/)
    DIR/test/<class>/*.png       (the same class names, or a subset of them)

``recipe.data.source=folder recipe.data.root=DIR`` reads it. Everything that can be checked
without decoding is checked once, at build time, with one message naming the path: the
layout, empty class folders, test classes unknown to train/, too many classes, and every
used image's size (PNG: its IHDR chunk; JPEG: its SOF segment). Images are decoded when
read, in the DataLoader workers (Pillow: torchvision 0.29 deprecated its own decoders), to
uint8 ``[C, H, W]``: gray images in a color recipe become three equal channels, and color
images in a gray recipe are converted to gray (Pillow's ITU-R 601-2 luma). Augmentation is not done here: it stays in the recipe's device-side
preprocess, inside the step. ``scripts/export_images.py`` writes such a folder.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

from trainer.data import read_every_item
from trainer.run.errors import ConfigError
from trainer.recipe import Datasets, Split

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPORT_HINT = "resize them, or write the folder with scripts/export_images.py"


class ImageFolderDataset(torch.utils.data.Dataset):
    """One split of an image folder: item ``i`` is (uint8 tensor ``shape``, int label), decoded on read.

    Paths and labels are held in numpy arrays rather than Python lists, so that forked
    DataLoader workers do not copy them page by page as reference counts change.
    """

    def __init__(self, root: str, files: List[str], labels: List[int], classes: List[str],
                 shape: Tuple[int, int, int]):
        self.root, self.classes, self.shape = str(root), list(classes), tuple(shape)
        self.files = np.array([f.encode() for f in files], dtype=bytes)  # relative to root
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.files[i].decode())

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        path = self.path(i)
        x = decode(path, gray=self.shape[0] == 1)
        if tuple(x.shape) != self.shape:  # headers were checked at build time: a file replaced since then
            raise ConfigError(f"{path} decodes to {_describe(x.shape)} but the recipe needs {_describe(self.shape)} "
                              f"images: {EXPORT_HINT}")
        return x, int(self.labels[i])

    def to_split(self, workers: Optional[int] = None) -> Split:
        """Every image decoded, in parallel worker processes: x uint8 [N, C, H, W], y int64 [N]."""
        return read_every_item(self, default_workers() if workers is None else workers)


def decode(path: str, *, gray: bool) -> torch.Tensor:
    """The image at ``path`` as uint8 ``[1, H, W]`` (``gray``) or ``[3, H, W]``, whatever its own mode."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.array(image.convert("L" if gray else "RGB"))  # a copy torch may own
    return torch.from_numpy(pixels).unsqueeze(0) if gray else torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def default_workers() -> int:
    """This rank's share of the machine's cores (ranks of one node decode at the same time)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(32, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def folder_datasets(root: str, *, recipe: str, shape: Tuple[int, int, int], num_classes: int, seed: int,
                    train_size: Optional[int] = None, test_size: Optional[int] = None,
                    data_key: str = "recipe.data") -> Datasets:
    """The train and test splits under ``root``, checked; ``train_size``/``test_size`` pick a
    seeded random subset (a prefix of the sorted files would hold only the first classes)."""
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"{data_key}.source=folder but {data_key}.root={root} is not a folder: set "
                          f"{data_key}.root=<folder with train/<class>/*.png and test/<class>/*.png> "
                          "(scripts/export_images.py writes one)")
    for split in ("train", "test"):
        if not (base / split).is_dir():
            raise ConfigError(f"{base / split} does not exist: {data_key}.source=folder reads "
                              f"{root}/train/<class>/*.png and {root}/test/<class>/*.png (.jpg too), as "
                              "torchvision's ImageFolder (scripts/export_images.py writes one)")
    train_images = _list_classes(base / "train")
    classes = sorted(train_images)
    if len(classes) > num_classes:
        raise ConfigError(f"{base / 'train'} has {len(classes)} class folders but the {recipe} model has "
                          f"{num_classes} outputs: keep at most {num_classes} classes")
    test_images = _list_classes(base / "test")
    unknown = sorted(set(test_images) - set(classes))
    if unknown:
        raise ConfigError(f"{base / 'test' / unknown[0]} is a class that {base / 'train'} does not have (train "
                          f"classes: {', '.join(classes)}): rename it to one of them or remove it")
    label = {name: i for i, name in enumerate(classes)}
    splits = []
    for split, images, size, key, stream in (("train", train_images, train_size, "train_size", 1),
                                             ("test", test_images, test_size, "test_size", 2)):
        files = [f"{split}/{name}/{file}" for name in sorted(images) for file in images[name]]
        labels = [label[name] for name in sorted(images) for _ in images[name]]
        if size is not None:
            if not 1 <= size <= len(files):
                raise ConfigError(f"{data_key}.{key}={size} but {base / split} has {len(files)} images: set "
                                  f"{data_key}.{key} between 1 and {len(files)}, or null for all of them")
            g = torch.Generator().manual_seed(seed * 7919 + stream)
            chosen = torch.randperm(len(files), generator=g)[:size].sort().values.tolist()
            files, labels = [files[i] for i in chosen], [labels[i] for i in chosen]
        check_image_sizes([str(base / f) for f in files], shape, recipe)
        splits.append(ImageFolderDataset(str(base), files, labels, classes, shape))
    return Datasets(train=splits[0], test=splits[1], source="folder")


def _list_classes(split_dir: Path) -> dict:
    """{class name: sorted image file names} of one split; hidden entries are skipped."""
    images = {}
    with os.scandir(split_dir) as entries:
        for entry in entries:
            if entry.is_dir() and not entry.name.startswith("."):
                with os.scandir(entry.path) as files:
                    images[entry.name] = sorted(f.name for f in files if not f.name.startswith(".")
                                                and f.name.lower().endswith(IMAGE_SUFFIXES) and f.is_file())
                if not images[entry.name]:
                    raise ConfigError(f"{entry.path} has no images ({', '.join(IMAGE_SUFFIXES)}): add some or "
                                      "remove the folder")
    if not images:
        raise ConfigError(f"{split_dir} has no class folders: put each class's images in {split_dir}/<class>/")
    return images


def check_image_sizes(paths: List[str], shape: Tuple[int, int, int], recipe: str) -> None:
    """Raises ConfigError at the first image whose header says it is not ``shape``'s height × width.

    Reads only headers: 25 bytes of a PNG; a JPEG up to its SOF segment."""
    _, height, width = shape
    for path in paths:
        w, h, bits = _png_header(path) if path.lower().endswith(".png") else _jpeg_header(path)
        if (w, h) != (width, height):
            raise ConfigError(f"{path} is {w}x{h} (width x height) but the {recipe} recipe needs {width}x{height} "
                              f"images ({_describe(shape)}): {EXPORT_HINT}")
        if bits > 8:  # (fewer bits, as in palette or 1-bit PNGs, decode to 8)
            raise ConfigError(f"{path} has {bits} bits per channel but the {recipe} recipe reads 8-bit images: convert "
                              f"them, or write the folder with scripts/export_images.py")


def _png_header(path: str) -> Tuple[int, int, int]:
    """(width, height, bit depth) from the IHDR chunk, which a PNG must begin with."""
    with open(path, "rb") as f:
        head = f.read(25)
    if len(head) < 25 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise ConfigError(f"{path} is not a PNG file (no PNG signature and IHDR chunk at its start): replace it "
                          "or remove it")
    width, height = struct.unpack(">II", head[16:24])
    return width, height, head[24]


def _jpeg_header(path: str) -> Tuple[int, int, int]:
    """(width, height, bits per sample) from the first SOF segment."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] != b"\xff\xd8":
        raise ConfigError(f"{path} is not a JPEG file (it does not begin with a JPEG start marker): replace it "
                          "or remove it")
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # segments without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) and i + 9 <= len(data):
            bits, height, width = data[i + 4], int.from_bytes(data[i + 5:i + 7], "big"), \
                int.from_bytes(data[i + 7:i + 9], "big")
            return width, height, bits
        i += 2 + length
    raise ConfigError(f"{path} is a damaged JPEG file (no frame header with its size): replace it or remove it")


def _describe(shape) -> str:
    c, h, w = shape
    return f"{c}x{h}x{w} {'grayscale' if c == 1 else 'RGB' if c == 3 else f'{c}-channel'}"
