"""How fast each JPEG decoder turns a folder into the step's random-resized crops, on this machine (issue 68).

    python scripts/make_image_folder.py --output /tmp/photos --classes 10 --per-class 800
    python scripts/bench_decode.py --root /tmp/photos                       # every decoder that is installed
    python scripts/bench_decode.py --root /tmp/photos --decoders pillow --workers 4 --batches 5   # a CPU

Each decoder produces what the training loader does: batches of ``--batch`` uint8 [3, size, size] crops of
train/ (torchvision's RandomResizedCrop box and a flip, drawn per sample by recipes/image_crops.py), and is timed
over one wall window from the end of its ``--warmup`` batches to the end of its last:
- ``pillow``: the repo's reader (recipes/image_folder.py RandomCropImageFolder: Pillow with ``Image.draft``, EXIF
  orientation applied) in ``--workers`` DataLoader processes;
- ``simplejpeg``: libjpeg-turbo through simplejpeg (its DCT scaling in place of draft, fast IDCT and upsampling;
  EXIF orientation not read), the box then resized by Pillow, in the same DataLoader;
- ``nvjpeg``: the files' bytes read by threads, decoded as one batch on the GPU by
  ``torchvision.io.decode_jpeg(device="cuda")``, each box cut and resized (bilinear, antialiased) on the GPU.
Prints a table and writes --output (JSON) with the commit, versions and GPU.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.lib.comparison import installed, provenance, provenance_line  # noqa: E402
from scripts.lib.refuse import refuse  # noqa: E402
from trainer.metrics.results import markdown_table, write_json  # noqa: E402

DECODERS = ("pillow", "simplejpeg", "nvjpeg")


class SimplejpegCrops:
    """The same samples as ``RandomCropImageFolder``, decoded by simplejpeg at the smallest DCT scale that keeps
    the box's pixels (a map-style dataset: DataLoader needs only len and getitem)."""

    def __init__(self, folder):
        self.folder = folder

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int):
        import numpy as np
        import simplejpeg
        import torch
        from PIL import Image

        from recipes.image_crops import random_resized_crop, sample_generator

        f, size = self.folder, self.folder.shape[1:]
        data = Path(f.path(i)).read_bytes()
        width, height, _, _ = simplejpeg.decode_jpeg_header(data)
        place = random_resized_crop(width, height, sample_generator(f.seed, f.epoch, i), f.crop_scale)
        left, top, right, bottom = place.box
        factor = max(size[1] / (right - left), size[0] / (bottom - top))
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True, fastupsample=True,
                                        min_width=math.ceil(width * factor), min_height=math.ceil(height * factor))
        sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
        image = Image.fromarray(pixels).resize((size[1], size[0]), Image.BILINEAR,
                                               box=(left * sx, top * sy, right * sx, bottom * sy))
        if place.flip:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous(), int(f.labels[i])


def time_loader(dataset, batch: int, batches: int, warmup: int, workers: int) -> float:
    import torch

    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                         drop_last=True, pin_memory=torch.cuda.is_available(),
                                         persistent_workers=False, prefetch_factor=4 if workers else None)
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = time.perf_counter() - start
    del it
    return batches * batch / elapsed


def time_nvjpeg(folder, batch: int, batches: int, warmup: int, threads: int) -> float:
    import torch
    import torch.nn.functional as F
    from torchvision.io import decode_jpeg

    from recipes.image_crops import random_resized_crop, sample_generator

    size = folder.shape[1:]
    out = torch.empty(batch, 3, *size, dtype=torch.uint8, device="cuda")
    order = torch.randperm(len(folder)).tolist()
    pool = ThreadPoolExecutor(threads)

    def read(i: int):
        data = Path(folder.path(i)).read_bytes()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def one_batch(k: int) -> None:
        picked = [order[(k * batch + j) % len(order)] for j in range(batch)]
        images = decode_jpeg(list(pool.map(read, picked)), device="cuda")
        for j, (i, image) in enumerate(zip(picked, images)):
            height, width = image.shape[1:]
            place = random_resized_crop(width, height, sample_generator(folder.seed, 0, i), folder.crop_scale)
            left, top, right, bottom = (int(round(c)) for c in place.box)
            crop = image[None, :, top:bottom, left:right].float()
            crop = F.interpolate(crop, size=size, mode="bilinear", antialias=True, align_corners=False)
            out[j] = (crop.flip(-1) if place.flip else crop)[0].round_().clamp_(0, 255).to(torch.uint8)

    for k in range(warmup):
        one_batch(k)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(warmup, warmup + batches):
        one_batch(k)
    torch.cuda.synchronize()
    return batches * batch / (time.perf_counter() - start)


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="an image folder (scripts/make_image_folder.py)")
    parser.add_argument("--decoders", nargs="+", choices=DECODERS, default=list(DECODERS))
    parser.add_argument("--size", type=int, default=224, help="the crops' side (224)")
    parser.add_argument("--batch", type=int, default=256, help="images a batch (256)")
    parser.add_argument("--batches", type=int, default=20, help="batches timed (20)")
    parser.add_argument("--warmup", type=int, default=3, help="batches before the window (3)")
    default_workers = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2) - 1)
    parser.add_argument("--workers", type=int, default=default_workers,
                        help=f"loader processes (the cores but one: {default_workers})")
    parser.add_argument("--output", type=Path, default=ROOT / "scripts" / "results" / "decode.json")
    args = parser.parse_args(argv)
    import torch  # after the command line: --help answers at once

    from recipes.image_folder import DEFAULT_CROP_SCALE, folder_datasets
    from trainer.run.errors import ConfigError

    if not args.root.is_dir():
        refuse(f"bench_decode.py: --root {args.root} is not a folder: give an image folder (train/<class>/*.jpg; "
               "scripts/make_image_folder.py writes one)")
    try:  # the folder as the training loader checks it
        data = folder_datasets(str(args.root), recipe="bench_decode", shape=(3, args.size, args.size),
                               num_classes=100_000, seed=0, crop_scale=DEFAULT_CROP_SCALE)
    except ConfigError as e:
        refuse(f"bench_decode.py: {e}")
    folder = data.train
    rows: List[Dict] = []
    for name in args.decoders:
        if name == "simplejpeg" and installed("simplejpeg") is None:
            print(f"bench_decode.py: simplejpeg is not installed (pip install simplejpeg): {name} skipped")
            continue
        if name == "nvjpeg" and not torch.cuda.is_available():
            print("bench_decode.py: no CUDA GPU: nvjpeg skipped")
            continue
        if name == "nvjpeg":
            rate = time_nvjpeg(folder, args.batch, args.batches, args.warmup, args.workers)
            how = f"GPU, {args.workers} reader threads"
        else:
            dataset = folder if name == "pillow" else SimplejpegCrops(folder)
            rate = time_loader(dataset, args.batch, args.batches, args.warmup, args.workers)
            how = f"{args.workers} DataLoader workers"
        rows.append({"decoder": name, "images_per_s": rate, "how": how, "version": installed(
            {"pillow": "pillow", "simplejpeg": "simplejpeg", "nvjpeg": "torchvision"}[name])})
        print(f"bench_decode.py: {name}: {rate:,.0f} images/s ({how})", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    measured = provenance(gpu)
    text = (markdown_table(["decoder", "images/s", "how", "version"],
                           [[r["decoder"], f"{r['images_per_s']:,.0f}", r["how"], r["version"]] for r in rows])
            + f"\n\n{len(folder)} JPEGs of {args.root} as random-resized {args.size}x{args.size} crops and flips, "
            f"batches of {args.batch}, {args.batches} timed after {args.warmup}; {os.cpu_count()} CPU cores. "
            f"{provenance_line(measured)}\n")
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, {"rows": rows, "provenance": measured, "cpu_cores": os.cpu_count()})
    args.output.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
