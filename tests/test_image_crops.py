"""Images of any size and mode become a recipe's fixed shape: converted as torchvision's references
load them, oriented by EXIF, cropped at random for training (the same crop for the same seed, epoch
and sample, wherever it is read) and at the center for evaluation; a JPEG decodes only as large as
its crop needs; a file that cannot be decoded gives its place to the next.

    python scripts/make_image_folder.py --output DIR --classes 4 --per-class 20
    python train.py recipe=cifar10_resnet18 recipe.data.source=folder recipe.data.root=DIR recipe.data.loader=host
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.availability import needs_extra
from recipes.image_crops import (UndecodableImage, center_crop, random_resized_crop, read_image,
                                 sample_generator)
from recipes.image_folder import folder_datasets
from trainer.data import HostLoader
from trainer.run.runtime import Runtime

CPU_RANK = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False, run_dir=None)


def save(path: Path, image, **options) -> Path:
    image.save(path, **options)
    return path


def pil(array: np.ndarray, mode=None):
    from PIL import Image

    return Image.fromarray(array, mode) if mode else Image.fromarray(array)


def pixels(tensor: torch.Tensor) -> np.ndarray:
    return tensor.permute(1, 2, 0).numpy() if tensor.shape[0] == 3 else tensor[0].numpy()


def folder(root: Path, sizes, *, classes=2, suffix=".png") -> Path:
    """train/ and test/ with ``sizes`` (w, h) images per class, smooth colors (which JPEG keeps)."""
    for split in ("train", "test"):
        for c in range(classes):
            (root / split / str(c)).mkdir(parents=True)
            for i, (w, h) in enumerate(sizes):
                y, x = np.mgrid[0:h, 0:w]
                image = np.dstack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), np.full_like(x, 60 * c)])
                save(root / split / str(c) / f"{i}{suffix}", pil(image.astype(np.uint8)), quality=95)
    return root


# ---- modes -------------------------------------------------------------------------------

@pytest.mark.fast
def test_each_mode_converts_as_torchvisions_loader_does_and_16_bit_gray_is_scaled_not_clipped(tmp_path):
    from PIL import Image

    sixteen = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)  # 0, 1, 128, 255 in 8 bits
    x = read_image(str(save(tmp_path / "16.png", pil(sixteen))), gray=False)
    assert Image.open(tmp_path / "16.png").mode == "I;16"  # what convert("RGB") would clip at 255
    assert x.shape == (3, 1, 4) and x[0, 0].tolist() == [0, 1, 128, 255] and torch.equal(x[0], x[2])
    assert read_image(str(tmp_path / "16.png"), gray=True)[0, 0].tolist() == [0, 1, 128, 255]

    gray = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    x = read_image(str(save(tmp_path / "l.png", pil(gray))), gray=False)
    assert all(np.array_equal(channel, gray) for channel in x.numpy())  # gray repeated into three channels

    rgba = np.dstack([np.full((2, 2), 200), np.full((2, 2), 100), np.full((2, 2), 50), np.full((2, 2), 7)])
    x = read_image(str(save(tmp_path / "a.png", pil(rgba.astype(np.uint8), "RGBA"))), gray=False)
    assert pixels(x)[0, 0].tolist() == [200, 100, 50]  # alpha dropped, not composited on a background
    la = np.dstack([np.full((2, 2), 90), np.full((2, 2), 3)]).astype(np.uint8)
    assert read_image(str(save(tmp_path / "la.png", pil(la, "LA"))), gray=False)[:, 0, 0].tolist() == [90] * 3

    palette = Image.new("P", (2, 2))
    palette.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    palette.putpixel((1, 1), 1)
    x = read_image(str(save(tmp_path / "p.png", palette, transparency=0)), gray=False)
    assert pixels(x)[0, 0].tolist() == [255, 0, 0] and pixels(x)[1, 1].tolist() == [0, 0, 255]

    cmyk = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # no black, full magenta and yellow: red
    x = read_image(str(save(tmp_path / "c.jpg", cmyk, quality=100)), gray=False)
    assert Image.open(tmp_path / "c.jpg").mode == "CMYK"
    assert np.abs(pixels(x).astype(int) - [255, 0, 0]).max() <= 3
    assert np.array_equal(pixels(x), np.array(Image.open(tmp_path / "c.jpg").convert("RGB")))


@pytest.mark.fast
def test_exif_orientation_turns_the_image_before_it_is_read_or_cropped(tmp_path):
    from PIL import Image

    stored = np.zeros((20, 40, 3), dtype=np.uint8)  # 40 wide, 20 high, a white mark at the top left
    stored[:5, :5] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to view"
    path = save(tmp_path / "turned.png", pil(stored), exif=exif.tobytes())
    x = read_image(str(path), gray=False)
    assert x.shape == (3, 40, 20)  # upright: 20 wide, 40 high
    assert np.array_equal(pixels(x), np.rot90(stored, k=-1))  # the mark now at the top right
    seen = []
    read_image(str(path), gray=False, out_size=(8, 8), place=lambda w, h: seen.append((w, h)) or center_crop(
        w, h, (8, 8), 0.875))
    assert seen == [(20, 40)]  # crops are drawn in the upright image's pixels
    jpeg = save(tmp_path / "turned.jpg", pil(stored), exif=exif.tobytes(), quality=95)
    assert read_image(str(jpeg), gray=False).shape == (3, 40, 20)


# ---- geometry ----------------------------------------------------------------------------

@pytest.mark.fast
def test_random_resized_crops_stay_inside_the_image_within_the_scale_and_ratio_and_flip_half_the_time():
    flips = 0
    for index in range(400):
        width, height = [(800, 600), (200, 799), (33, 31), (640, 640)][index % 4]
        p = random_resized_crop(width, height, sample_generator(3, 0, index), (0.08, 1.0))
        left, top, right, bottom = p.box
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
        area, ratio = (right - left) * (bottom - top) / (width * height), (right - left) / (bottom - top)
        assert 0.07 <= area <= 1.0 and 3 / 4 - 0.1 <= ratio <= 4 / 3 + 0.1  # within rounding of whole pixels
        flips += p.flip
    assert 150 < flips < 250
    # an image too wide for any ratio in [3/4, 4/3] falls back to its central crop of the nearest ratio
    assert random_resized_crop(1000, 10, sample_generator(0, 0, 0), (0.9, 1.0)).box == (493, 0, 506, 10)


@pytest.mark.fast
def test_a_samples_crop_depends_on_seed_epoch_and_index_alone():
    def box(seed, epoch, index):
        return random_resized_crop(800, 600, sample_generator(seed, epoch, index), (0.08, 1.0))

    assert box(0, 1, 5) == box(0, 1, 5)
    assert len({box(0, epoch, 5) for epoch in range(10)}) == 10  # a new crop every epoch
    assert box(0, 1, 5) != box(0, 1, 6) and box(0, 1, 5) != box(1, 1, 5)


def test_the_crops_are_torchvisions_the_eval_crop_centered_after_resizing_as_the_references_do(tmp_path):
    from PIL import Image
    from torchvision.transforms import RandomResizedCrop, v2

    # RandomResizedCrop's fallback (its 10 tries all fail on so wide an image) is deterministic: the same box
    top, left, h, w = RandomResizedCrop.get_params(torch.zeros(1, 10, 1000), [0.9, 1.0], [3 / 4, 4 / 3])
    assert random_resized_crop(1000, 10, sample_generator(0, 0, 0), (0.9, 1.0)).box == (left, top, left + w, top + h)

    left, top, right, bottom = center_crop(400, 300, (32, 32), 0.875).box  # shorter side 300 -> int(32/0.875) = 36
    assert (right - left, bottom - top) == pytest.approx((300 * 32 / 36, 300 * 32 / 36))
    assert (left + right) / 2 == pytest.approx(200) and (top + bottom) / 2 == pytest.approx(150)
    y, x = np.mgrid[0:300, 0:400]
    smooth = np.dstack([x * 255 // 399, y * 255 // 299, (x + y) * 255 // 698]).astype(np.uint8)
    path = save(tmp_path / "smooth.png", pil(smooth))
    ours = read_image(str(path), gray=False, out_size=(32, 32),
                      place=lambda w, h: center_crop(w, h, (32, 32), 0.875))
    theirs = v2.Compose([v2.Resize(36), v2.CenterCrop(32), v2.PILToTensor()])(Image.open(path).convert("RGB"))
    assert (ours.int() - theirs.int()).abs().max() <= 6  # one resampling instead of two, half a pixel apart at most


@pytest.mark.fast
@pytest.mark.parametrize("gray", [False, True])
def test_a_box_is_resized_by_pillows_filter_within_one_level_and_rounded_to_whole_pixels(tmp_path, gray):
    """torch's antialiased bilinear kernel on uint8 replaces Pillow's resize: the same filter, so the same pixels
    within one level, shrinking or enlarging, on detail as fine as noise, as torchvision's RandomResizedCrop makes
    them (the box cut out, then resized: no pixel outside it counts); the flip mirrors the result."""
    from PIL import Image

    from recipes.image_crops import pixel_box, resized

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (300, 280) if gray else (300, 280, 3), dtype=np.uint8)
    for box, out in (((20, 10, 250, 290), (64, 48)), ((5, 7, 41, 30), (64, 64)), ((0, 0, 280, 300), (224, 224))):
        crop = image[box[1]:box[3], box[0]:box[2]]
        theirs = np.array(pil(crop).resize(out[::-1], Image.BILINEAR)).astype(int)
        ours = resized(crop, out, flip=False)
        assert ours.shape == ((1,) if gray else (3,)) + out and ours.dtype == torch.uint8 and ours.is_contiguous()
        assert np.abs(pixels(ours).astype(int) - theirs).max() <= 1
        assert torch.equal(resized(crop, out, flip=True), ours.flip(-1))
    assert pixel_box((10.4, 2.6, 99.5, 50.2), (100, 60)) == (10, 3, 100, 50)  # the nearest whole pixels
    assert pixel_box((-0.3, 59.8, 0.2, 60.4), (100, 60)) == (0, 59, 1, 60)  # inside the image, one pixel at least


DECODERS = ["pillow", pytest.param("simplejpeg", marks=pytest.mark.extras)]
# (crop scale, output size): boxes decoded at 1/8 down to 1 of the file's size, and enlarged
CROPS = (((0.9, 1.0), (32, 32)), ((0.2, 0.5), (48, 40)), ((0.9, 1.0), (224, 224)), ((0.5, 1.0), (70, 64)),
         ((0.08, 0.2), (24, 24)))


def decoder_available(name: str) -> None:
    if name == "simplejpeg":
        needs_extra("simplejpeg")


@pytest.mark.fast
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("orientation", [1, 6])
def test_a_large_jpeg_decodes_at_the_scale_its_crop_needs_and_gives_the_full_decodes_pixels(tmp_path, monkeypatch,
                                                                                            orientation, decoder):
    from PIL import Image

    import recipes.image_crops as crops

    decoder_available(decoder)
    y, x = np.mgrid[0:600, 0:800]
    photo = np.dstack([x * 255 // 799, y * 255 // 599, ((x // 40 + y // 40) % 2) * 200]).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation  # 6: stored on its side, the crop drawn in the upright 600x800 image
    path = str(save(tmp_path / "photo.jpg", pil(photo), quality=92, exif=exif.tobytes()))
    scales = []
    original = crops.dct_scale
    monkeypatch.setattr(crops, "dct_scale", lambda *args: scales.append(original(*args)) or scales[-1])

    def crop(w, h):
        return random_resized_crop(w, h, sample_generator(0, 0, 1), (0.5, 1.0))

    small = read_image(path, gray=False, out_size=(32, 32), place=crop, jpeg_decoder=decoder)
    assert scales[-1] >= 4  # decoded at 1/4 or 1/8: the crop keeps >= 32 pixels a side
    monkeypatch.setattr(crops, "dct_scale", lambda *args: 1)
    full = read_image(path, gray=False, out_size=(32, 32), place=crop, jpeg_decoder=decoder)
    assert (small.float() - full.float()).abs().mean() < 4  # what the model sees is the same picture


@pytest.mark.extras
def test_simplejpeg_gives_pillows_pixels_for_every_scale_mode_subsampling_and_orientation(tmp_path):
    """The optional decoder is a speed-up only: on detail as fine as noise, every DCT scale (crops from the whole
    image down to 1/8), gray and color output, gray/4:2:0/4:4:4/progressive files and all eight EXIF orientations,
    its samples equal Pillow's bit for bit; a CMYK JPEG and a truncated one go to Pillow, which reads the first as
    before and names the second."""
    from PIL import Image

    needs_extra("simplejpeg")
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (300, 440, 3), dtype=np.uint8)
    smooth = np.repeat(np.repeat(noise[::20, ::20], 20, 0), 20, 1)[:300, :440]
    photo = ((noise.astype(int) + 3 * smooth) // 4).astype(np.uint8)
    files = {"420": dict(quality=90), "444": dict(quality=95, subsampling=0),
             "progressive": dict(quality=80, progressive=True)}
    paths = []
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        for name, options in files.items():
            paths.append(save(tmp_path / f"{name}-{orientation}.jpg", pil(photo), exif=exif.tobytes(), **options))
        paths.append(save(tmp_path / f"gray-{orientation}.jpg", pil(photo[:, :, 0]), exif=exif.tobytes(),
                          quality=90))
    compared = 0
    for path in paths:
        for gray in (False, True):
            whole = [read_image(str(path), gray=gray, jpeg_decoder=d) for d in ("pillow", "simplejpeg")]
            assert torch.equal(*whole), path
            for index, (scale, out) in enumerate(CROPS):
                crops = [read_image(str(path), gray=gray, out_size=out, jpeg_decoder=d,
                                    place=lambda w, h: random_resized_crop(w, h, sample_generator(0, 0, index), scale))
                         for d in ("pillow", "simplejpeg")]
                assert torch.equal(*crops), (path, gray, scale, out)
                compared += 1
    assert compared == len(paths) * 2 * len(CROPS)
    from recipes.image_crops import dct_scale
    assert {dct_scale((0, 0, 440, 300), out, 440, 300) for out in ((32, 32), (70, 64), (224, 224))} == {8, 4, 1}
    cmyk = save(tmp_path / "c.jpg", Image.fromarray(photo).convert("CMYK"), quality=95)
    assert torch.equal(read_image(str(cmyk), gray=False, jpeg_decoder="simplejpeg"),
                       read_image(str(cmyk), gray=False, jpeg_decoder="pillow"))
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(paths[0].read_bytes()[:2000])
    with pytest.raises(UndecodableImage, match="(?i)truncated"):
        read_image(str(broken), gray=False, jpeg_decoder="simplejpeg")


# ---- undecodable files -------------------------------------------------------------------

@pytest.mark.fast
def test_a_truncated_jpeg_is_skipped_named_and_counted_and_the_next_image_takes_its_place(tmp_path, capsys):
    root = folder(tmp_path / "images", [(60, 40), (50, 70), (64, 64)], suffix=".jpg")
    broken = root / "train" / "0" / "1.jpg"
    broken.write_bytes(broken.read_bytes()[:400])  # the header is whole, the body is cut
    with pytest.raises(UndecodableImage, match="(?i)truncated"):
        read_image(str(broken), gray=False)
    data = folder_datasets(str(root), recipe="cifar10_resnet18", shape=(3, 32, 32), num_classes=10, seed=0)
    train = data.train
    i = next(k for k in range(len(train)) if train.path(k) == str(broken))
    x, label = train[i]
    assert x.shape == (3, 32, 32) and label == int(train.labels[i + 1])
    assert torch.equal(x, train.read(i + 1, i, 1))  # the next file, with the crop drawn for this place
    err = capsys.readouterr().err
    assert f"WARNING: {broken} could not be decoded" in err and "truncated" in err.lower()
    assert f"{train.path(i + 1)} read in its place; files skipped so far in {root}: 1" in err
    train[i]
    assert int(train.skipped) == 2 and capsys.readouterr().err == ""  # counted again, named once


# ---- the epoch reaches the workers -------------------------------------------------------

def epoch_batches(train, epoch: int, workers: int, skip: int = 0):
    """(each step's dataset indices, each step's batch) of one epoch through the host loader, from step ``skip``."""
    loader = HostLoader(train, 4, CPU_RANK, train=True, seed=0, num_workers=workers, drop_last=True)
    try:
        loader.start_epoch(epoch)
        loader.skip(skip)
        out = []
        for _ in range(loader.steps - skip):
            loader.stage()
            out.append({k: v.clone() for k, v in loader.next_batch().items()})
        return [row.tolist() for row in loader.epoch_rows(epoch)[0][skip:]], out
    finally:
        loader.close()


def test_workers_read_the_crops_of_the_loaders_epoch_and_a_resumed_epoch_reads_the_same(tmp_path):
    """Persistent workers keep their copy of the dataset across epochs: each batch request carries its epoch.
    The crops of (seed, epoch, index) whether read in the rank or by 2 workers, and resuming mid-epoch reads
    what an unbroken epoch read."""
    root = folder(tmp_path / "images", [(60, 40), (50, 70), (64, 64), (90, 45)])
    train = folder_datasets(str(root), recipe="cifar10_resnet18", shape=(3, 32, 32), num_classes=10,
                            seed=5).train
    reference = pickle.loads(pickle.dumps(train))  # read item by item, outside any loader

    def expected(rows, epoch):
        reference.set_epoch(epoch)
        return [torch.stack([reference[i][0] for i in row]) for row in rows]

    rows, in_process = epoch_batches(train, 2, workers=0)
    rows_too, two_workers = epoch_batches(train, 2, workers=2)
    assert rows == rows_too and len(rows) == 2
    for batch, by_workers, x in zip(in_process, two_workers, expected(rows, 2)):
        assert torch.equal(batch["x"], x) and torch.equal(by_workers["x"], x)
    assert not any(torch.equal(a, b) for a, b in zip(expected(rows, 1), expected(rows, 2)))  # new crops each epoch
    resumed_rows, resumed = epoch_batches(train, 2, workers=2, skip=1)
    assert resumed_rows == rows[1:] and torch.equal(resumed[0]["x"], in_process[1]["x"])


# ---- the folder maker ----------------------------------------------------------------------

TINY = ["--classes", "3", "--per-class", "6", "--test-per-class", "2", "--min-side", "60", "--max-side", "160",
        "--workers", "1"]


@pytest.mark.fast
def test_make_image_folder_writes_sizes_and_shapes_of_many_kinds_once_and_reuses_them(tmp_path, capsys):
    from PIL import Image

    from scripts.make_image_folder import main

    output = tmp_path / "shapes"
    assert main([*TINY, "--output", str(output), "--val", "--odd-modes"]) == 0
    assert f"wrote {output}" in capsys.readouterr().out
    files = sorted(output.rglob("*.*"))
    assert sorted({p.parent.parent.name for p in files if p.name != "manifest.json"}) == ["train", "val"]
    images = [p for p in files if p.suffix in (".jpg", ".png")]
    assert len(images) == 3 * 8
    sizes = [Image.open(p).size for p in images]
    assert all(60 <= min(s) and max(s) <= 160 for s in sizes)
    assert len(set(sizes)) > 15 and {w > h for w, h in sizes} == {True, False}  # landscape and portrait
    assert {Image.open(p).mode for p in images} == {"RGB", "L", "RGBA", "CMYK", "P"}
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["arguments"]["per_class"] == 6 and manifest["arguments"]["val"] is True
    before = {p: p.stat().st_mtime_ns for p in images}
    assert main([*TINY, "--output", str(output), "--val", "--odd-modes"]) == 0
    assert capsys.readouterr().out.startswith(f"reusing {output}")
    assert {p: p.stat().st_mtime_ns for p in images} == before
    with pytest.raises(SystemExit) as refused:
        main([*TINY, "--output", str(output), "--seed", "1"])
    assert refused.value.code == 2 and "seed=0 (asked 1)" in capsys.readouterr().err
    data = folder_datasets(str(output), recipe="cifar10_resnet18", shape=(3, 32, 32), num_classes=10, seed=0)
    assert "in val/ (the test split)" in capsys.readouterr().out
    assert all(data.train[i][0].shape == (3, 32, 32) for i in range(len(data.train)))  # every mode reads


@pytest.mark.fast
def test_the_folder_makers_classes_are_learnable():
    """A nearest-class-mean on 8x8 center crops already tells the classes apart: a small model can do better."""
    from scripts.make_image_folder import draw_image

    def tiny(c, i, split):
        image = torch.from_numpy(draw_image(np.random.default_rng([0, split, c, i]), c, 5, 0, 40, 80))
        return torch.nn.functional.interpolate(image.permute(2, 0, 1)[None].float(), size=(8, 8),
                                               mode="area").flatten()

    means = torch.stack([torch.stack([tiny(c, i, 0) for i in range(8)]).mean(0) for c in range(5)])
    right = sum(int(torch.cdist(tiny(c, i, 1)[None], means).argmin()) == c for c in range(5) for i in range(6))
    assert right >= 0.8 * 30
