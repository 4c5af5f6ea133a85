"""Writes an image recipe's data as a folder of PNG files that `recipe.data.source=folder` reads.

    python scripts/export_images.py recipe=mnist --output data/mnist_png
    python scripts/export_images.py recipe=cifar10_resnet18 recipe.data.source=synthetic --output /tmp/c --limit 1000
    python scripts/export_images.py --config-dir my_conf recipe=mine --output data/mine_png   # your own configs
    python train.py recipe=mnist recipe.data.source=folder recipe.data.root=data/mnist_png

The recipe builds its data as train.py would, from any train.py overrides (real data or the
synthetic stand-in, whatever `recipe.data.source` resolves to). Each image becomes
`<output>/<split>/<class>/<index>.png`: the class folder is the label ("0".."9"), the index
the image's position in its split, zero-padded so that file order is split order.
`--limit N` writes at most the first N images of each split. PNG encoding and writing run
in `--workers` processes. Prints what it wrote.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.run.cli import script_config  # noqa: E402
from trainer.run.errors import ConfigError  # noqa: E402

if TYPE_CHECKING:  # torch and the recipes are imported where used: `--help` and a bad override answer at once
    import numpy as np
    import torch

IMAGES_PER_TASK = 2000


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="folder to create (must be empty or absent)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many images per split")
    parser.add_argument("--workers", type=int, default=None,
                        help="encoding processes (default: this process's share of the CPU cores)")
    args, cfg = script_config(parser, argv, defaults=["logger=none"])
    from recipes.image_folder import default_workers

    try:
        print(export(cfg, args.output, limit=args.limit, workers=args.workers or default_workers()), flush=True)
    except ConfigError as e:
        print(f"Error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def export(cfg, output: Path, *, limit: Optional[int] = None, workers: int = 1) -> str:
    """Writes the folder of the recipe in ``cfg`` (conf.schema.compose); returns the line that says what was written."""
    import torch

    from trainer.session import build_recipe_alone

    began = time.monotonic()
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit {limit} must be at least 1 (or left out for every image)")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"--output {output} exists and is not an empty folder: name a new folder "
                          "(files left from an earlier export would mix with this one)")
    data = build_recipe_alone(cfg).data
    splits = {name: images_of(getattr(data, name), cfg.recipe.name, limit) for name in ("train", "test")}
    import PIL.PngImagePlugin  # noqa: F401  before the workers fork: each would import it again

    built = time.monotonic()
    tasks = []
    for name, (x, y) in splits.items():
        width = len(str(len(y) - 1))
        labels = y.tolist()
        for label in set(labels):
            os.makedirs(output / name / str(label), exist_ok=True)
        paths = [f"{output}/{name}/{label}/{i:0{width}d}.png" for i, label in enumerate(labels)]
        array = x.numpy()
        tasks += [(array[lo:lo + IMAGES_PER_TASK], paths[lo:lo + IMAGES_PER_TASK])
                  for lo in range(0, len(paths), IMAGES_PER_TASK)]
    if workers > 1 and len(tasks) > 1:
        # fork: the workers need nothing re-imported, and they share the parent's view of sys.path.
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context,
                                 initializer=torch.set_num_threads, initargs=(1,)) as pool:
            list(pool.map(write_pngs, *zip(*tasks)))  # one image at a time per process, many processes
    else:
        for images, paths in tasks:
            write_pngs(images, paths)
    (n_train, classes), (n_test, _) = [(len(y), len(set(y.tolist()))) for _, y in splits.values()]
    c, h, w = splits["train"][0].shape[1:]
    return (f"wrote {n_train} train and {n_test} test images ({c}x{h}x{w} PNG, {classes} classes, "
            f"{data.source} data of recipe {cfg.recipe.name}) to {output} in {time.monotonic() - began:.1f} s "
            f"({time.monotonic() - built:.1f} s writing); "
            f"train on them with recipe={cfg.recipe.name} recipe.data.source=folder recipe.data.root={output}")


def images_of(split, recipe: str, limit: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` images (uint8 [N, C, H, W], 1 or 3 channels) and integer labels of a split."""
    import torch

    from trainer.recipe import Split

    if isinstance(split, Split) or hasattr(split, "to_split"):
        whole = split.to_split()
        x, y = whole.x[:limit], whole.y[:limit]
    else:  # any map-style dataset of (image, label)
        items = [split[i] for i in range(min(len(split), limit or len(split)))]
        x, y = torch.stack([item[0] for item in items]), torch.as_tensor([int(item[1]) for item in items])
    if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] not in (1, 3) or y.dim() != 1:
        raise ConfigError(f"recipe={recipe} gives samples of {x.dtype} {list(x.shape[1:])} with labels of shape "
                          f"{list(y.shape[1:])}, not images (uint8 [C, H, W], 1 or 3 channels) with one label: "
                          "export_images.py writes the image recipes' data (recipe=mnist, recipe=cifar10_resnet18)")
    return x.contiguous(), y


def write_pngs(images: np.ndarray, paths: List[str]) -> None:
    """Encodes each [C, H, W] uint8 image as PNG (Pillow) and writes it to its path."""
    import io

    from PIL import Image

    for image, path in zip(images, paths):
        encoded = io.BytesIO()
        Image.fromarray(image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)).save(encoded, format="PNG")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # a third of open()'s cost per file
        try:
            os.write(fd, encoded.getbuffer())
        finally:
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
