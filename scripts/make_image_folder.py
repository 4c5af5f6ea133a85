"""Writes a folder of JPEG photos-to-be: ImageNet's spread of sizes, classes a small model can learn.

    python scripts/make_image_folder.py --output data/shapes                 # 10 classes x 100, test 20 each
    python scripts/make_image_folder.py --output /tmp/tiny --classes 4 --per-class 20 --test-per-class 5
    python train.py recipe=cifar10_resnet18 recipe.data.source=folder recipe.data.root=data/shapes \\
        recipe.data.loader=host recipe.data.num_workers=4

Nothing is downloaded, so a folder to train and measure image input on is made here:
``<output>/train/<class>/<n>.jpg`` and ``<output>/test/<class>/<n>.jpg`` (``--val``: ``val/``, as
ImageNet names it). Each image is ``--min-side`` to ``--max-side`` pixels a side with an aspect
ratio from ImageNet's common ones (4:3, 3:4, 1:1, 3:2, 2:3, 16:9), JPEG quality 75 to 95. A class is
a background hue and a stripe angle and period (relative to the image, so a crop of any scale sees
them); each image jitters them, shifts the stripes, adds a blob of another color and noise.
``--odd-modes`` makes some images grayscale or CMYK JPEGs and some RGBA or palette PNGs, to cover
what the folder reader converts.

Written once, reused: the folder is built beside ``--output`` and renamed into place with
``manifest.json`` (its arguments and sizes) written last. The same arguments again print the
manifest's line and write nothing; other arguments for an existing folder are refused (exit 2).
"""
from __future__ import annotations

import argparse
import colorsys
import io
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.lib.refuse import refuse  # noqa: E402

MANIFEST = "manifest.json"
ASPECTS = ((4 / 3, 0.45), (3 / 4, 0.2), (1.0, 0.15), (3 / 2, 0.1), (2 / 3, 0.05), (16 / 9, 0.05))  # (w / h, share)
QUALITY = (75, 95)
IMAGES_PER_TASK = 32


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="the folder to write (or reuse)")
    parser.add_argument("--classes", type=int, default=10, help="class folders (default 10)")
    parser.add_argument("--per-class", type=int, default=100, help="training images per class (default 100)")
    parser.add_argument("--test-per-class", type=int, default=20, help="test images per class (default 20)")
    parser.add_argument("--min-side", type=int, default=200, help="shortest side in pixels (default 200)")
    parser.add_argument("--max-side", type=int, default=800, help="longest side in pixels (default 800)")
    parser.add_argument("--seed", type=int, default=0, help="every pixel follows from it (default 0)")
    parser.add_argument("--val", action="store_true", help="name the test split val/, as ImageNet does")
    parser.add_argument("--odd-modes", action="store_true",
                        help="some grayscale and CMYK JPEGs, some RGBA and palette PNGs")
    parser.add_argument("--workers", type=int, default=None,
                        help="encoding processes (default: the CPU cores this process may use)")
    args = parser.parse_args(argv)
    for name in ("classes", "per_class", "test_per_class", "min_side"):
        if getattr(args, name) < 1:
            refuse(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.max_side < args.min_side:
        refuse(f"--max-side {args.max_side} is below --min-side {args.min_side}: set --max-side {args.min_side} "
               "or more")
    arguments = {key: getattr(args, key) for key in ("classes", "per_class", "test_per_class", "min_side",
                                                     "max_side", "seed", "val", "odd_modes")}
    print(make_folder(args.output, arguments, workers=args.workers or _cores()), flush=True)
    return 0


def make_folder(output: Path, arguments: Dict, *, workers: int = 1) -> str:
    """Writes the folder (or finds it written with the same ``arguments``); returns the line that says which."""
    manifest = output / MANIFEST
    if output.exists():
        if not manifest.is_file():
            refuse(f"--output {output} exists and was not written by this script (no {MANIFEST}): name a new folder")
        made = json.loads(manifest.read_text())
        if made["arguments"] != arguments:
            differ = ", ".join(f"{k}={made['arguments'].get(k)!r} (asked {v!r})" for k, v in arguments.items()
                               if made["arguments"].get(k) != v)
            refuse(f"--output {output} holds a folder made with other arguments: {differ}; name a new folder, or "
                   "ask for those")
        return f"reusing {output}: {made['summary']}"
    began = time.monotonic()
    partial = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        tasks = _tasks(partial, arguments)
        if workers > 1 and len(tasks) > 1:
            # fork: the workers need nothing re-imported and share the parent's sys.path
            context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
            with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context) as pool:
                written = [size for sizes in pool.map(_write_images, tasks) for size in sizes]
        else:
            written = [size for task in tasks for size in _write_images(task)]
        widths, heights = [w for w, _ in written], [h for _, h in written]
        test = "val" if arguments["val"] else "test"
        summary = (f"{arguments['classes'] * arguments['per_class']} train and "
                   f"{arguments['classes'] * arguments['test_per_class']} {test}/ images, {arguments['classes']} "
                   f"classes, {min(widths)}-{max(widths)} x {min(heights)}-{max(heights)} pixels")
        (partial / MANIFEST).write_text(json.dumps({"made_by": "scripts/make_image_folder.py", "arguments": arguments,
                                                    "summary": summary}, indent=1) + "\n")
        output.parent.mkdir(parents=True, exist_ok=True)
        os.rename(partial, output)  # whole or not at all
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return (f"wrote {output} in {time.monotonic() - began:.1f} s: {summary}; train on it with recipe=cifar10_resnet18 "
            f"recipe.data.source=folder recipe.data.root={output} recipe.data.loader=host")


def _tasks(root: Path, arguments: Dict) -> List[Tuple]:
    """Batches of (folder, split, class, image number in the class, in the folder) for the workers, every
    class folder made."""
    classes = arguments["classes"]
    width = len(str(classes - 1))
    items = []
    for split, count in (("train", arguments["per_class"]), ("val" if arguments["val"] else "test",
                                                            arguments["test_per_class"])):
        for c in range(classes):
            folder = root / split / f"class{c:0{width}d}"
            folder.mkdir(parents=True)
            items += [(folder, split, c, i, len(items) + i) for i in range(count)]
    return [(items[lo:lo + IMAGES_PER_TASK], arguments) for lo in range(0, len(items), IMAGES_PER_TASK)]


def _write_images(task) -> List[Tuple[int, int]]:
    """Draws, encodes and writes one batch of images; their (width, height)."""
    items, arguments = task
    sizes = []
    for folder, split, c, i, n in items:
        rng = np.random.default_rng([arguments["seed"], 0 if split == "train" else 1, c, i])
        image = draw_image(rng, c, arguments["classes"], arguments["seed"], arguments["min_side"],
                           arguments["max_side"])
        data, suffix = encode(image, rng, n if arguments["odd_modes"] else None)
        (folder / f"{i:05d}{suffix}").write_bytes(data)
        sizes.append((image.shape[1], image.shape[0]))
    return sizes


def class_look(c: int, classes: int, seed: int) -> Tuple[float, float, float]:
    """Class ``c``'s (hue, stripe angle in radians, stripe period as a share of the shorter side)."""
    offset = np.random.default_rng([seed, 7]).random()
    hue = (offset + c / classes) % 1.0  # evenly spread: the strongest cue
    angle = ((c * 0.618034) % 1.0) * np.pi
    period = 1 / (4 + 12 * ((c * 0.381966) % 1.0))  # 4 to 16 stripes across the shorter side
    return hue, angle, period


def draw_image(rng: np.random.Generator, c: int, classes: int, seed: int, min_side: int,
               max_side: int) -> np.ndarray:
    """One RGB image (uint8 [H, W, 3]) of class ``c``: its look, jittered, with a blob and noise."""
    aspect = ASPECTS[rng.choice(len(ASPECTS), p=[share for _, share in ASPECTS])][0] * rng.uniform(0.95, 1.05)
    long_side = int(rng.integers(min_side, max_side + 1))
    short_side = int(np.clip(round(long_side / max(aspect, 1 / aspect)), min_side, long_side))
    width, height = (long_side, short_side) if aspect >= 1 else (short_side, long_side)
    hue, angle, period = class_look(c, classes, seed)
    hue += rng.normal(0, 0.02)
    background = np.array(colorsys.hsv_to_rgb(hue % 1, rng.uniform(0.5, 0.9), rng.uniform(0.55, 0.95)), np.float32)
    stripes = np.array(colorsys.hsv_to_rgb((hue + 0.5) % 1, rng.uniform(0.3, 0.7), rng.uniform(0.2, 0.5)), np.float32)
    y, x = np.arange(height, dtype=np.float32)[:, None], np.arange(width, dtype=np.float32)[None, :]
    along = (x * np.float32(np.cos(angle)) + y * np.float32(np.sin(angle))) * np.float32(
        2 * np.pi / (period * min(width, height)))
    mix = np.sin(along + np.float32(rng.uniform(0, 2 * np.pi))) * np.float32(0.5) + np.float32(0.5)
    mix *= np.float32(rng.uniform(0.5, 0.9))
    image = background * 255 + ((stripes - background) * 255) * mix[..., None]
    cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(0.1, 0.3) * min(width, height)
    blob = ((y - np.float32(cy)) ** 2 + (x - np.float32(cx)) ** 2) < np.float32(r * r)
    image[blob] = rng.random(3, dtype=np.float32) * 255  # a distractor of any color
    image += rng.standard_normal((height, width, 1), dtype=np.float32) * np.float32(10)
    return np.clip(image, 0, 255).astype(np.uint8)


def encode(image: np.ndarray, rng: np.random.Generator, odd: Optional[int]) -> Tuple[bytes, str]:
    """The image as a JPEG (quality 75-95); with ``odd`` (the image's number in the folder) every fifth one
    in an odd mode: grayscale JPEG, RGBA PNG, CMYK JPEG, palette PNG in turn."""
    from PIL import Image

    picture, out = Image.fromarray(image), io.BytesIO()
    mode = None if odd is None or odd % 5 != 2 else ("L", "RGBA", "CMYK", "P")[(odd // 5) % 4]
    if mode in ("RGBA", "P"):
        if mode == "RGBA":
            alpha = np.linspace(40, 255, image.shape[1], dtype=np.float32)[None, :].repeat(image.shape[0], 0)
            picture.putalpha(Image.fromarray(alpha.astype(np.uint8)))
        else:
            picture = picture.quantize(64)
        picture.save(out, format="PNG", compress_level=1)
        return out.getvalue(), ".png"
    if mode is not None:
        picture = picture.convert(mode)
    picture.save(out, format="JPEG", quality=int(rng.integers(QUALITY[0], QUALITY[1] + 1)))
    return out.getvalue(), ".jpg"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


if __name__ == "__main__":
    sys.exit(main())
