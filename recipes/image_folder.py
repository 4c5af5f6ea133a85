"""Images from a folder laid out as torchvision's ImageFolder, for the image recipes.

    DIR/train/<class>/*.jpg      (or .jpeg/.png; classes: the sorted subfolder names of train/)
    DIR/test/<class>/*.jpg       (or DIR/val/, ImageNet's name; the same classes or some of them)

``recipe.data.source=folder recipe.data.root=DIR`` reads it. Images may be of any size and mode
(recipes/image_crops.py converts them as torchvision's references do, EXIF orientation applied):

- a folder whose images all have the recipe's shape (``scripts/export_images.py`` writes one) is
  read as it is, unless ``recipe.data.crop_scale`` is set; either loader may hold it.
- otherwise training reads random-resized crops and flips, new each epoch (``crop_scale``), and
  evaluation the center crop after resizing (``recipe.data.eval_resize_ratio``). Such a training set
  has ``set_epoch``: the host loader serves it (DataLoader workers), telling it each epoch.

Everything that headers tell is checked once, at build time, with one message naming the path: the
layout, empty class folders, test classes unknown to train/, too many classes, files that are not
PNG or JPEG, images too small to crop from, JPEGs of more than 8 bits. What only decoding shows (a
truncated or damaged body) is skipped when read: a warning names the file and the count so far,
and the next file takes the sample's place, so that a batch keeps its shape and an epoch never stops.
Decoding happens when an item is read, in the DataLoader workers (Pillow). Everything after the
recipe's shape (normalization, further augmentation) stays in the recipe's device-side preprocess.
"""
from __future__ import annotations

import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from recipes.image_crops import (UndecodableImage, center_crop, default_jpeg_decoder, random_resized_crop,
                                 read_image, sample_generator)
from trainer.data import read_every_item
from trainer.data.workers import MAX_WORKERS, cores_per_rank
from trainer.recipe import Datasets, Split
from trainer.run.errors import ConfigError
from trainer.run.runtime import print_once

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TEST_DIRS = ("test", "val")  # the test split's folder: ours, then ImageNet's
DEFAULT_CROP_SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop
REPLACEMENTS = 64  # undecodable files in a row before a read gives up on the folder
HEADER_THREADS = 16  # header reads wait on the disk, not the CPU


class ImageFolderDataset(torch.utils.data.Dataset):
    """One split of an image folder: item ``i`` is (uint8 tensor ``shape``, int label), decoded on read.

    ``eval_resize_ratio`` None: every image has ``shape`` already and is read as it is; else the
    center crop of the image resized to ``shape``'s size / the ratio. A file Pillow cannot decode
    gives its place to the next one (see the module docstring). ``jpeg_decoder``: what decodes a JPEG's body
    (recipes/image_crops.py ``read_image``; the same pixels either way). Paths and labels are held in numpy
    arrays rather than Python lists, so that forked DataLoader workers do not copy them page by page
    as reference counts change.
    """

    def __init__(self, root: str, files: List[str], labels: List[int], classes: List[str],
                 shape: Tuple[int, int, int], *, eval_resize_ratio: Optional[float] = None):
        self.root, self.classes, self.shape = str(root), list(classes), tuple(shape)
        self.files = np.array([f.encode() for f in files], dtype=bytes)  # relative to root
        self.labels = np.asarray(labels, dtype=np.int64)
        self.eval_resize_ratio = eval_resize_ratio
        self.jpeg_decoder = default_jpeg_decoder()
        # Files skipped so far by this split's readers: pickled to DataLoader workers as shared memory.
        self.skipped = torch.zeros(1, dtype=torch.int64)
        self._warned: set = set()

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.files[i].decode())

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        for attempt in range(min(REPLACEMENTS, len(self))):
            j = (i + attempt) % len(self)
            try:
                return self.read(j, i, attempt), int(self.labels[j])
            except UndecodableImage as e:
                self._warn_skipped(j, (j + 1) % len(self), str(e))
        raise RuntimeError(f"{min(REPLACEMENTS, len(self))} files in a row from {self.path(i)} on could not be "
                           "decoded (each named above): check the folder with Pillow")

    def read(self, j: int, i: int, attempt: int) -> torch.Tensor:
        """File ``j``'s pixels for sample ``i`` (``attempt`` > 0: a replacement for sample ``i``'s own file)."""
        path, gray = self.path(j), self.shape[0] == 1
        if self.eval_resize_ratio is not None:
            return read_image(path, gray=gray, out_size=self.shape[1:], jpeg_decoder=self.jpeg_decoder,
                              place=lambda w, h: center_crop(w, h, self.shape[1:], self.eval_resize_ratio))
        x = read_image(path, gray=gray, jpeg_decoder=self.jpeg_decoder)
        if tuple(x.shape) != self.shape:  # headers were checked at build time: a file replaced since then
            raise UndecodableImage(f"it decodes to {_describe(x.shape)}, not the {_describe(self.shape)} its header "
                                   "said when the run began")
        return x

    def _warn_skipped(self, j: int, replacement: int, reason: str) -> None:
        self.skipped += 1
        if j not in self._warned:  # once per file in each process; the count goes on
            self._warned.add(j)
            print(f"WARNING: {self.path(j)} could not be decoded ({reason}): skipped, {self.path(replacement)} read "
                  f"in its place; files skipped so far in {self.root}: {int(self.skipped)}", file=sys.stderr,
                  flush=True)

    def to_split(self, workers: Optional[int] = None) -> Split:
        """Every image decoded, in parallel worker processes: x uint8 [N, C, H, W], y int64 [N]."""
        return read_every_item(self, default_workers() if workers is None else workers)


class RandomCropImageFolder(ImageFolderDataset):
    """A training split read as random-resized crops and flips, drawn per (seed, epoch, sample index):
    the same inputs in eager and graphed runs, with any number of workers or ranks, and after a resume.

    ``set_epoch`` is the contract with the host loader (trainer/data/host_loader.py), which sends the
    epoch with every batch it asks its workers for."""

    def __init__(self, root: str, files: List[str], labels: List[int], classes: List[str],
                 shape: Tuple[int, int, int], *, seed: int, crop_scale: Tuple[float, float]):
        super().__init__(root, files, labels, classes, shape)
        self.seed, self.crop_scale, self.epoch = seed, tuple(crop_scale), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def read(self, j: int, i: int, attempt: int) -> torch.Tensor:
        rng = sample_generator(self.seed, self.epoch, i, attempt)
        return read_image(self.path(j), gray=self.shape[0] == 1, out_size=self.shape[1:],
                          jpeg_decoder=self.jpeg_decoder,
                          place=lambda w, h: random_resized_crop(w, h, rng, self.crop_scale))

    def __repr__(self) -> str:
        return f"random-resized crops of the {len(self)} images in {self.root}/train, new each epoch"


def default_workers() -> int:
    """Processes that read a whole split once, before training: this rank's share of the cores (the ranks of one
    node decode at the same time)."""
    return min(MAX_WORKERS, cores_per_rank())


def folder_datasets(root: str, *, recipe: str, shape: Tuple[int, int, int], num_classes: int, seed: int,
                    train_size: Optional[int] = None, test_size: Optional[int] = None,
                    crop_scale: Optional[Tuple[float, float]] = None, eval_resize_ratio: float = 0.875,
                    data_key: str = "recipe.data") -> Datasets:
    """The train and test splits under ``root``, checked; ``train_size``/``test_size`` pick a
    seeded random subset (a prefix of the sorted files would hold only the first classes).
    ``crop_scale`` None: random-resized crops of (0.08, 1) of the area where the images' sizes differ
    from ``shape``, none where they all match; set: crops whatever the sizes."""
    base = Path(root)
    _check_crop_settings(crop_scale, eval_resize_ratio, data_key)
    if not base.is_dir():
        raise ConfigError(f"{data_key}.source=folder but {data_key}.root={root} is not a folder: set "
                          f"{data_key}.root=<folder with train/<class>/*.jpg and test/<class>/*.jpg> "
                          "(scripts/make_image_folder.py and scripts/export_images.py write one)")
    test_dir = next((name for name in TEST_DIRS if (base / name).is_dir()), None)
    if not (base / "train").is_dir() or test_dir is None:
        missing = base / ("train" if not (base / "train").is_dir() else "test")
        raise ConfigError(f"{missing} does not exist: {data_key}.source=folder reads {root}/train/<class>/*.jpg and "
                          f"{root}/test/<class>/*.jpg (or val/; .png too), as torchvision's ImageFolder "
                          "(scripts/make_image_folder.py writes one)")
    train_images = _list_classes(base / "train")
    classes = sorted(train_images)
    if len(classes) > num_classes:
        raise ConfigError(f"{base / 'train'} has {len(classes)} class folders but the {recipe} model has "
                          f"{num_classes} outputs: keep at most {num_classes} classes")
    test_images = _list_classes(base / test_dir)
    unknown = sorted(set(test_images) - set(classes))
    if unknown:
        raise ConfigError(f"{base / test_dir / unknown[0]} is a class that {base / 'train'} does not have (train "
                          f"classes: {', '.join(classes)}): rename it to one of them or remove it")
    label = {name: i for i, name in enumerate(classes)}
    chosen = {}
    for split, images, size, key, stream in (("train", train_images, train_size, "train_size", 1),
                                             (test_dir, test_images, test_size, "test_size", 2)):
        files = [f"{split}/{name}/{file}" for name in sorted(images) for file in images[name]]
        labels = [label[name] for name in sorted(images) for _ in images[name]]
        if size is not None:
            if not 1 <= size <= len(files):
                raise ConfigError(f"{data_key}.{key}={size} but {base / split} has {len(files)} images: set "
                                  f"{data_key}.{key} between 1 and {len(files)}, or null for all of them")
            g = torch.Generator().manual_seed(seed * 7919 + stream)
            picked = torch.randperm(len(files), generator=g)[:size].sort().values.tolist()
            files, labels = [files[i] for i in picked], [labels[i] for i in picked]
        chosen[split] = (files, labels)
    sizes = image_sizes([str(base / f) for files, _ in chosen.values() for f in files], shape, recipe)
    mixed = any(size != (shape[2], shape[1]) for size in sizes)
    (train_files, train_labels), (test_files, test_labels) = chosen["train"], chosen[test_dir]
    if not mixed and crop_scale is None:
        if eval_resize_ratio != 0.875:
            raise ConfigError(f"{data_key}.eval_resize_ratio={eval_resize_ratio} is read when a folder's images are "
                              f"cropped, and every image in {root} is {shape[2]}x{shape[1]} already: remove it, or set "
                              f"{data_key}.crop_scale=[0.08,1.0] to crop these too")
        train = ImageFolderDataset(str(base), train_files, train_labels, classes, shape)
        test = ImageFolderDataset(str(base), test_files, test_labels, classes, shape)
        how = f"all {shape[2]}x{shape[1]}: read as they are"
    else:
        scale = DEFAULT_CROP_SCALE if crop_scale is None else tuple(crop_scale)
        train = RandomCropImageFolder(str(base), train_files, train_labels, classes, shape, seed=seed,
                                      crop_scale=scale)
        test = ImageFolderDataset(str(base), test_files, test_labels, classes, shape,
                                  eval_resize_ratio=eval_resize_ratio)
        widths, heights = [w for w, _ in sizes], [h for _, h in sizes]
        how = (f"widths {min(widths)}-{max(widths)} and heights {min(heights)}-{max(heights)} pixels: training on "
               f"random-resized crops "
               f"({data_key}.crop_scale=[{scale[0]},{scale[1]}]) and flips drawn anew each epoch, so the host loader "
               f"serves them; evaluating on center crops (shorter side to {int(max(shape[1:]) / eval_resize_ratio)})"
               + ("; JPEGs decoded by simplejpeg" if train.jpeg_decoder == "simplejpeg" else
                  "; JPEGs decoded by Pillow (pip install -r requirements-images.txt: simplejpeg decodes the same "
                  "pixels in less CPU)"))
    missing_classes = sorted(set(classes) - set(test_images))
    print_once(f"{data_key}.root={root}: {len(train)} images in train/ and {len(test)} in {test_dir}/ (the test split)"
               f", {len(classes)} classes, {how}"
               + (f"; {test_dir}/ has no images of class {', '.join(missing_classes)}: evaluation leaves "
                  f"{'it' if len(missing_classes) == 1 else 'them'} out" if missing_classes else ""))
    return Datasets(train=train, test=test, source="folder")


def _check_crop_settings(crop_scale, eval_resize_ratio: float, data_key: str) -> None:
    if crop_scale is not None and not (len(crop_scale) == 2 and 0 < crop_scale[0] <= crop_scale[1] <= 1):
        raise ConfigError(f"{data_key}.crop_scale={list(crop_scale)} must be two shares of the image's area, "
                          f"0 < low <= high <= 1: set {data_key}.crop_scale=[0.08,1.0] (torchvision's), or null")
    if not 0 < eval_resize_ratio <= 1:
        raise ConfigError(f"{data_key}.eval_resize_ratio={eval_resize_ratio} must be in (0, 1]: the center crop's "
                          f"share of the resized shorter side; set {data_key}.eval_resize_ratio=0.875 (224 of 256)")


def _list_classes(split_dir: Path) -> Dict[str, List[str]]:
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


def image_sizes(paths: List[str], shape: Tuple[int, int, int], recipe: str) -> List[Tuple[int, int]]:
    """Each image's (width, height) as its header says; ConfigError at the first file that is not a
    PNG or JPEG, an image too small to crop from (a side under a quarter of the recipe's), or a JPEG
    Pillow cannot decode (more than 8 bits). Reads a few bytes of each file: PNG's IHDR chunk, a
    JPEG's segments up to its frame header."""
    smallest = max(2, min(shape[1:]) // 4)

    def size_of(path: str) -> Tuple[int, int]:
        width, height = image_header(path)
        if min(width, height) < smallest:
            raise ConfigError(f"{path} is {width}x{height} (width x height), too small to crop from: the {recipe} "
                              f"recipe reads images of at least {smallest}x{smallest} (a quarter of its "
                              f"{shape[2]}x{shape[1]}): remove it or replace it")
        return width, height

    if len(paths) < 256:
        return [size_of(p) for p in paths]
    with ThreadPoolExecutor(HEADER_THREADS) as pool:
        return list(pool.map(size_of, paths, chunksize=64))  # the first bad file in order raises


def image_header(path: str) -> Tuple[int, int]:
    """(width, height) of a PNG or JPEG file, whatever its name says, from its header."""
    with open(path, "rb") as f:
        head = f.read(24)
        if head.startswith(PNG_SIGNATURE):
            if len(head) < 24 or head[12:16] != b"IHDR":
                raise ConfigError(f"{path} is a damaged PNG file (no IHDR chunk after its signature): replace it or "
                                  "remove it")
            return struct.unpack(">II", head[16:24])
        if head.startswith(b"\xff\xd8"):
            f.seek(2)
            return _jpeg_size(f, path)
    raise ConfigError(f"{path} is not an image: its first bytes are neither a PNG's nor a JPEG's signature "
                      f"({head[:8]!r}): replace it or remove it")


def _jpeg_size(f, path: str) -> Tuple[int, int]:
    """(width, height) from the first SOF segment, walking the segments' lengths from after SOI."""
    while True:
        byte = f.read(1)
        if not byte:
            break
        if byte != b"\xff":  # stray bytes between segments, which Pillow skips too
            continue
        code = f.read(1)
        while code == b"\xff":  # fill bytes
            code = f.read(1)
        if not code or code[0] == 0xD9:  # the end, and no frame
            break
        if code[0] == 0x01 or 0xD0 <= code[0] <= 0xD8:  # segments without a length
            continue
        length = f.read(2)
        if len(length) < 2 or int.from_bytes(length, "big") < 2:  # (a length counts its own two bytes)
            break
        if 0xC0 <= code[0] <= 0xCF and code[0] not in (0xC4, 0xC8, 0xCC):
            frame = f.read(5)
            if len(frame) < 5:
                break
            bits, height, width = frame[0], int.from_bytes(frame[1:3], "big"), int.from_bytes(frame[3:5], "big")
            if bits != 8:
                raise ConfigError(f"{path} is a {bits}-bit JPEG, which Pillow cannot decode: convert it to 8 bits or "
                                  "remove it")
            return width, height
        f.seek(int.from_bytes(length, "big") - 2, os.SEEK_CUR)
    raise ConfigError(f"{path} is a damaged JPEG file (no frame header with its size): replace it or remove it")


def _describe(shape) -> str:
    c, h, w = shape
    return f"{c}x{h}x{w} {'grayscale' if c == 1 else 'RGB' if c == 3 else f'{c}-channel'}"
