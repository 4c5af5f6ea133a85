"""How fast each JPEG decoder turns a folder into the step's random-resized crops, on this machine (issue 68).

    python scripts/make_image_folder.py --output /tmp/photos --classes 10 --per-class 800
    python scripts/bench_decode.py --root /tmp/photos                       # every decoder that is installed
    python scripts/bench_decode.py --root /tmp/photos --decoders pillow --workers 4 --batches 5   # a CPU

Each decoder produces what the training loader does: batches of ``--batch`` uint8 [3, size, size] crops of
train/ (torchvision's RandomResizedCrop box and a flip, drawn per sample by recipes/image_crops.py), and is timed
over one wall window from the end of its ``--warmup`` batches (for the loaders, after those their workers had in
flight at the start: the steady state) to the end of its last:
- ``pillow``: the repo's reader (recipes/image_folder.py RandomCropImageFolder: JPEGs decoded by Pillow at the DCT
  scale the crop needs, EXIF orientation applied) in ``--workers`` DataLoader processes;
- ``simplejpeg``: the same reader with the JPEGs' bodies decoded by simplejpeg (``jpeg_decoder="simplejpeg"``, what
  training uses when it is installed: the same pixels), in the same DataLoader;
- ``nvjpeg``: the files' bytes read by threads, decoded as one batch on the GPU by
  ``torchvision.io.decode_jpeg(device="cuda")``, each box cut and resized (bilinear, antialiased) on the GPU;
- ``nvjpeg_decode``: the same decoding without the crops (what the GPU's decoder alone gives).
``--contention SECONDS``: bf16 matmuls timed alone and beside the batched decode, to see whether the decode takes
SMs from a training step or runs on the GPU's JPEG engines.
Prints a table and writes --output (JSON) with the commit, versions and GPU.
"""
from __future__ import annotations

import argparse
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

DECODERS = ("pillow", "simplejpeg", "nvjpeg", "nvjpeg_decode")


PREFETCH = 4  # batches each worker keeps in flight (DataLoader's prefetch_factor)


def time_loader(dataset, batch: int, batches: int, warmup: int, workers: int) -> float:
    """images/s of a DataLoader over ``dataset`` at its steady state: samples drawn with replacement (no epoch end
    in the window), and the window opens only after the batches the workers had in flight when the loader started
    (``workers * PREFETCH``) and ``warmup`` more have arrived. Timed from the third batch of a fresh loader (as
    before), every worker's first batch, decoded while the first three were, arrived at once: 15 workers over one
    epoch of 23 batches read 20 batches in the time of one worker's batch, a third above their steady rate."""
    import torch

    sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=1 << 40,
                                             generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers,
                                         drop_last=True, pin_memory=torch.cuda.is_available(),
                                         persistent_workers=False, prefetch_factor=PREFETCH if workers else None)
    it = iter(loader)
    for _ in range(warmup + workers * PREFETCH):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = time.perf_counter() - start
    del it
    return batches * batch / elapsed


def time_nvjpeg(folder, batch: int, batches: int, warmup: int, threads: int, crops: bool = True) -> float:
    """images/s of batched nvJPEG decoding (``crops``: and each box cut, resized and flipped on the GPU)."""
    import torch

    decode = NvjpegBatches(folder, batch, threads)
    for k in range(warmup):
        decode(k, crops)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(warmup, warmup + batches):
        decode(k, crops)
    torch.cuda.synchronize()
    return batches * batch / (time.perf_counter() - start)


class NvjpegBatches:
    """Batch ``k`` of the folder's files: bytes read by threads, decoded as one batch on the GPU
    (``torchvision.io.decode_jpeg(device="cuda")``), then (``crops``) each box resized (bilinear, antialiased) into a
    float batch that is flipped, rounded and cast to uint8 once for the whole batch."""

    def __init__(self, folder, batch: int, threads: int):
        import torch

        self.folder, self.batch, self.size = folder, batch, folder.shape[1:]
        self.order = torch.randperm(len(folder)).tolist()
        self.pool = ThreadPoolExecutor(threads)
        self.crops = torch.empty(batch, 3, *self.size, device="cuda")

    def read(self, i: int):
        import torch

        return torch.frombuffer(bytearray(Path(self.folder.path(i)).read_bytes()), dtype=torch.uint8)

    def __call__(self, k: int, crops: bool = True):
        import torch
        import torch.nn.functional as F
        from torchvision.io import decode_jpeg

        from recipes.image_crops import random_resized_crop, sample_generator

        picked = [self.order[(k * self.batch + j) % len(self.order)] for j in range(self.batch)]
        images = decode_jpeg(list(self.pool.map(self.read, picked)), device="cuda")
        if not crops:
            return images
        flips = []
        for j, (i, image) in enumerate(zip(picked, images)):
            height, width = image.shape[1:]
            place = random_resized_crop(width, height, sample_generator(self.folder.seed, 0, i),
                                        self.folder.crop_scale)
            left, top, right, bottom = (int(round(c)) for c in place.box)
            self.crops[j] = F.interpolate(image[None, :, top:bottom, left:right].float(), size=self.size,
                                          mode="bilinear", antialias=True, align_corners=False)[0]
            flips.append(place.flip)
        flip = torch.tensor(flips, device="cuda")[:, None, None, None]
        return torch.where(flip, self.crops.flip(-1), self.crops).round_().clamp_(0, 255).to(torch.uint8)


def decode_contention(folder, batch: int, threads: int, seconds: float) -> Dict[str, float]:
    """How much of the GPU batched nvJPEG decoding takes from a step: bf16 matmuls (8192^3) on a stream of their own,
    TFLOP/s alone and while a thread decodes batches back to back, and the decode's images/s alone and beside
    them. Where the decode runs on the GPU's JPEG engines (torchvision asks nvJPEG for its hardware backend first),
    the matmuls keep their rate; on the SMs they lose the share the decode takes."""
    import threading

    import torch

    decode = NvjpegBatches(folder, batch, threads)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    stream = torch.cuda.Stream()

    def matmuls(until: float) -> float:
        done, start = 0, time.perf_counter()
        with torch.cuda.stream(stream):
            while time.perf_counter() < until:
                for _ in range(8):
                    torch.mm(a, b, out=c)
                stream.synchronize()
                done += 8
        return done * 2 * 8192 ** 3 / (time.perf_counter() - start) / 1e12

    def decodes(until: float) -> float:
        done, start = 0, time.perf_counter()
        while time.perf_counter() < until:
            decode(done // batch, crops=False)
            torch.cuda.current_stream().synchronize()  # this thread's stream: not the matmuls' (non-blocking)
            done += batch
        return done / (time.perf_counter() - start)

    decodes(time.perf_counter() + 2.0)  # warm: nvJPEG's buffers, the page cache
    matmuls(time.perf_counter() + 1.0)
    alone = {"matmul_tflops_alone": matmuls(time.perf_counter() + seconds),
             "decode_images_per_s_alone": decodes(time.perf_counter() + seconds)}
    beside: Dict[str, float] = {}
    until = time.perf_counter() + seconds
    thread = threading.Thread(target=lambda: beside.update(decode_images_per_s_beside=decodes(until)))
    thread.start()
    beside["matmul_tflops_beside"] = matmuls(until)
    thread.join()
    result = {**alone, **beside}
    result["matmul_share_lost"] = 1 - result["matmul_tflops_beside"] / result["matmul_tflops_alone"]
    return result


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="an image folder (scripts/make_image_folder.py)")
    parser.add_argument("--decoders", nargs="+", choices=DECODERS, default=list(DECODERS))
    parser.add_argument("--size", type=int, default=224, help="the crops' side (224)")
    parser.add_argument("--batch", type=int, default=256, help="images a batch (256)")
    parser.add_argument("--batches", type=int, default=40, help="batches timed (40)")
    parser.add_argument("--warmup", type=int, default=3, help="batches before the window (3)")
    default_workers = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2) - 1)
    parser.add_argument("--workers", type=int, default=default_workers,
                        help=f"loader processes (the cores but one: {default_workers})")
    parser.add_argument("--contention", type=float, default=0.0, metavar="SECONDS",
                        help="on a GPU, also time bf16 matmuls alone and beside batched nvJPEG decoding, SECONDS "
                             "each: how much of the GPU the decode takes from a training step (default 0: not run)")
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
        if name.startswith("nvjpeg") and not torch.cuda.is_available():
            print(f"bench_decode.py: no CUDA GPU: {name} skipped")
            continue
        if name.startswith("nvjpeg"):
            rate = time_nvjpeg(folder, args.batch, args.batches, args.warmup, args.workers, crops=name == "nvjpeg")
            how = f"GPU, {args.workers} reader threads" + ("" if name == "nvjpeg" else ", decoding only (no crops)")
        else:
            folder.jpeg_decoder = name
            rate = time_loader(folder, args.batch, args.batches, args.warmup, args.workers)
            how = f"{args.workers} DataLoader workers"
        rows.append({"decoder": name, "images_per_s": rate, "how": how, "version": installed(
            {"pillow": "pillow", "simplejpeg": "simplejpeg"}.get(name, "torchvision"))})
        print(f"bench_decode.py: {name}: {rate:,.0f} images/s ({how})", flush=True)
    contention = None
    if args.contention > 0 and torch.cuda.is_available():
        contention = decode_contention(folder, args.batch, args.workers, args.contention)
        print(f"bench_decode.py: contention: {contention}", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    measured = provenance(gpu)
    text = (markdown_table(["decoder", "images/s", "how", "version"],
                           [[r["decoder"], f"{r['images_per_s']:,.0f}", r["how"], r["version"]] for r in rows])
            + f"\n\n{len(folder)} JPEGs of {args.root} as random-resized {args.size}x{args.size} crops and flips, "
            f"batches of {args.batch}, {args.batches} timed after {args.warmup}; {os.cpu_count()} CPU cores. "
            f"{provenance_line(measured)}\n")
    if contention:
        text += (f"\nbf16 matmuls (8192^3) on a stream of their own: {contention['matmul_tflops_alone']:,.0f} TFLOP/s "
                 f"alone, {contention['matmul_tflops_beside']:,.0f} beside batched nvJPEG decoding "
                 f"({100 * contention['matmul_share_lost']:.1f}% lost); the decode "
                 f"{contention['decode_images_per_s_alone']:,.0f} images/s alone, "
                 f"{contention['decode_images_per_s_beside']:,.0f} beside them ({args.contention:g} s each).\n")
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.output, {"rows": rows, "contention": contention, "provenance": measured,
                             "cpu_cores": os.cpu_count()})
    args.output.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
