"""How a stored image of any size and mode becomes one uint8 sample of a recipe's shape.

Modes are converted as torchvision's references load images (Pillow's ``convert("RGB")``; ``"L"``
for a gray recipe): palette and CMYK through Pillow's tables, alpha dropped (not composited onto a
background), gray repeated into three channels. A 16-bit gray PNG (Pillow's ``I;16``, which
``convert`` would clip at 255) is scaled to 8 bits, ``round(value / 257)``; 16-bit color PNGs
Pillow already reads as 8-bit (their high byte). EXIF orientation is applied (the transposes of
Pillow's ``ImageOps.exif_transpose``) before anything else, so crops are drawn in the image as a
viewer shows it; torchvision's references do not apply it.

Geometry, in the oriented image's pixels:
- training, ``random_resized_crop``: torchvision's RandomResizedCrop rule (an area share drawn
  from ``scale``, a log-uniform aspect ratio in [3/4, 4/3], up to 10 tries, else the center crop
  of the nearest allowed ratio), then a horizontal flip with probability 1/2; both drawn from
  ``sample_generator(seed, epoch, index)``, so a sample's crop depends on nothing else (worker,
  rank, eager or graphed, resumed or not).
- evaluation, ``center_crop``: the shorter side resized to ``int(size / eval_resize_ratio)`` (the
  references' 256 for 224) and the center ``size`` cut out.
The box, rounded to whole pixels of the decoded image, is cut out and resized by one antialiased
bilinear resampling (``resized``: torch's kernel on uint8, the filter of Pillow's and torchvision's
``antialias=True``; as in RandomResizedCrop no pixel outside the box counts). A JPEG decodes at the
smallest DCT scale (1, 1/2, 1/4, 1/8) that still gives the box at least the output's pixels
(``dct_scale``, Pillow's ``draft`` rule): an 800-pixel photo cropped to 32 decodes at 1/8 of its size.
A color or gray JPEG's body is decoded by simplejpeg where it is installed (``default_jpeg_decoder``: the
same libjpeg-turbo call with the same settings, so the same pixels, in less CPU), by Pillow otherwise.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

Box = Tuple[float, float, float, float]  # left, top, right, bottom
CROP_STREAM = 0x1C80  # keeps these draws apart from any other use of the run seed
SIXTEEN_BIT_GRAY = ("I;16", "I;16L", "I;16B", "I;16N", "I")
TURNED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
# What turns each EXIF orientation upright (the table of Pillow's ImageOps.exif_transpose, by name)
EXIF_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
                  7: "TRANSVERSE", 8: "ROTATE_90"}
RATIO = (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop default


class UndecodableImage(Exception):
    """Pillow could not decode the file (a truncated or damaged body): headers looked right."""


@dataclass(frozen=True)
class Placement:
    """Where the output comes from: ``box`` of the oriented image, mirrored when ``flip``."""
    box: Box
    flip: bool = False


def sample_generator(seed: int, epoch: int, index: int, attempt: int = 0) -> np.random.Generator:
    """The generator of one sample's crop: a function of these numbers alone. ``attempt`` > 0 draws
    for a replacement file after the sample's own could not be decoded."""
    return np.random.default_rng([seed % 2**63, epoch, index, attempt, CROP_STREAM])


def random_resized_crop(width: int, height: int, rng: np.random.Generator,
                        scale: Tuple[float, float]) -> Placement:
    """torchvision's RandomResizedCrop box (its ``get_params``), and a flip with probability 1/2."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return Placement((left, top, left + w, top + h), flip=bool(rng.random() < 0.5))
    # No try fitted: the center crop of the allowed ratio nearest the image's own
    if width / height < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif width / height > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return Placement((left, top, left + w, top + h), flip=bool(rng.random() < 0.5))


def center_crop(width: int, height: int, out_size: Tuple[int, int], eval_resize_ratio: float) -> Placement:
    """The box that resizing the shorter side to ``int(max(out) / eval_resize_ratio)`` and cutting out
    the center ``out_size`` (height, width) would keep, in the image's own pixels."""
    out_h, out_w = out_size
    factor = int(max(out_h, out_w) / eval_resize_ratio) / min(width, height)
    box_w, box_h = min(width, out_w / factor), min(height, out_h / factor)
    left, top = (width - box_w) / 2, (height - box_h) / 2
    return Placement((left, top, left + box_w, top + box_h))


def default_jpeg_decoder() -> str:
    """"simplejpeg" where it is installed (requirements-images.txt), else "pillow". Both run libjpeg-turbo with
    the same settings (accurate integer IDCT, smooth chroma upsampling, the same DCT scale), so they give the same
    pixels (tests/test_image_crops.py); simplejpeg decodes into one array without Pillow's intermediate image, in
    about a third less CPU a JPEG (docs/data.md, "Which decoder")."""
    try:
        import simplejpeg  # noqa: F401
    except ImportError:
        return "pillow"
    return "simplejpeg"


def read_image(path: str, *, gray: bool, out_size: Optional[Tuple[int, int]] = None,
               place: Optional[Callable[[int, int], Placement]] = None,
               jpeg_decoder: str = "pillow") -> torch.Tensor:
    """The image at ``path`` as uint8 ``[1, H, W]`` (``gray``) or ``[3, H, W]``, oriented by its EXIF tag.

    Without ``place``: the whole image. With it: ``place(width, height)`` of the oriented image
    picks the box, resized to ``out_size`` (height, width). ``jpeg_decoder`` "simplejpeg" decodes the body of a
    color or gray JPEG (Pillow still reads its header and EXIF, and decodes every other file). Raises
    UndecodableImage when Pillow cannot decode the file."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            data = f.read()
        image = Image.open(io.BytesIO(data))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise UndecodableImage(f"{type(e).__name__}: {e}") from None
    with image:
        try:
            orientation = image.getexif().get(0x0112, 1)  # (a PNG may keep its EXIF after the pixels: read here)
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise UndecodableImage(f"{type(e).__name__}: {e}") from None
        width, height = image.size[::-1] if orientation in TURNED else image.size
        placement = place(width, height) if place is not None else None
        scale = dct_scale(placement.box, out_size, width, height) if placement and image.format == "JPEG" else 1
        try:
            pixels = None
            if jpeg_decoder == "simplejpeg" and image.format == "JPEG" and image.mode in ("RGB", "L"):
                pixels = _simplejpeg_pixels(data, gray, scale, image.size, orientation)
            if pixels is None:
                pixels = _pillow_pixels(image, gray, scale, orientation)
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise UndecodableImage(f"{type(e).__name__}: {e}") from None
    if placement is not None:
        scale_x, scale_y = pixels.shape[1] / width, pixels.shape[0] / height  # < 1 where the JPEG decoded smaller
        left, top, right, bottom = placement.box
        box = pixel_box((left * scale_x, top * scale_y, right * scale_x, bottom * scale_y), pixels.shape[1::-1])
        return resized(pixels[box[1]:box[3], box[0]:box[2]], out_size, placement.flip)
    x = torch.from_numpy(pixels)
    return x.unsqueeze(0) if gray else x.permute(2, 0, 1).contiguous()


def dct_scale(box: Box, out_size: Tuple[int, int], width: int, height: int) -> int:
    """The largest JPEG DCT scale divisor (1, 2, 4, 8) at which ``box`` of a ``width`` x ``height`` image still
    has at least ``out_size``'s (height, width) pixels: the decoder then computes that much less. Pillow's
    ``draft`` rule, in the upright image (turning swaps both sides, so the scale is the same)."""
    left, top, right, bottom = box
    factor = max(out_size[1] / (right - left), out_size[0] / (bottom - top))
    fits = min(width // math.ceil(width * factor), height // math.ceil(height * factor))  # 0: the box is enlarged
    return next((s for s in (8, 4, 2) if fits >= s), 1)


def pixel_box(box: Box, size: Tuple[int, int]) -> Tuple[int, int, int, int]:
    """``box`` rounded to whole pixels of an image of ``size`` (width, height), at least one pixel a side."""
    width, height = size
    left, top = min(max(round(box[0]), 0), width - 1), min(max(round(box[1]), 0), height - 1)
    return left, top, min(max(round(box[2]), left + 1), width), min(max(round(box[3]), top + 1), height)


def resized(crop: np.ndarray, out_size: Tuple[int, int], flip: bool) -> torch.Tensor:
    """uint8 ``crop`` ([H, W] or [H, W, C]) as ``[C, *out_size]``, resized by torch's antialiased bilinear filter on
    uint8 (Pillow's filter, within one level: tests/test_image_crops.py) and mirrored when ``flip``. torch's kernel
    takes the pixels as Pillow lays them out (channels last) and, on a worker's one thread, resizes a
    random-resized crop in about 40% of the time of Pillow's ``resize`` with the array conversion that followed it
    (0.35 against 0.9 ms on 224-pixel crops of 200-800-pixel JPEGs): a quarter of a worker's time per image."""
    x = torch.from_numpy(crop)
    x = x[None, None] if x.dim() == 2 else x.permute(2, 0, 1)[None]
    x = torch.nn.functional.interpolate(x, size=tuple(out_size), mode="bilinear", antialias=True, align_corners=False)[0]
    return (x.flip(-1) if flip else x).contiguous()


def _simplejpeg_pixels(data: bytes, gray: bool, scale: int, stored_size: Tuple[int, int], orientation: int):
    """The JPEG in ``data`` decoded by simplejpeg at 1/``scale`` and turned upright: an ``[H, W]`` (``gray``) or
    ``[H, W, 3]`` array; None where libjpeg-turbo reports a problem (Pillow then decodes it, or names what is
    wrong, as it does for every file without simplejpeg)."""
    import simplejpeg

    width, height = stored_size
    try:  # simplejpeg picks the smallest of libjpeg-turbo's eighths-scales that keeps these sizes: 1/scale
        pixels = simplejpeg.decode_jpeg(data, colorspace="GRAY" if gray else "RGB",
                                        min_width=-(-width // scale), min_height=-(-height // scale))
    except ValueError:
        return None
    return _upright(pixels[:, :, 0] if gray else pixels, orientation)


def _pillow_pixels(image, gray: bool, scale: int, orientation: int) -> np.ndarray:
    """The file's pixels decoded by Pillow (a JPEG at 1/``scale``), turned upright, in mode "L" or "RGB", as an
    ``[H, W]`` or ``[H, W, 3]`` array."""
    if image.format == "JPEG" and (gray or scale > 1):
        width, height = image.size
        image.draft("L" if gray else image.mode, (width // scale, height // scale) if scale > 1 else None)
    image.load()
    return _upright(np.array(eight_bit(image, gray)), orientation)


def _upright(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """``pixels`` as stored, turned as their EXIF ``orientation`` says a viewer shows them (Pillow's transposes)."""
    if orientation not in EXIF_TRANSPOSE:
        return pixels
    from PIL import Image

    return np.array(Image.fromarray(pixels).transpose(Image.Transpose[EXIF_TRANSPOSE[orientation]]))


def eight_bit(image, gray: bool):
    """``image`` in mode "L" (``gray``) or "RGB", as torchvision's loader converts it; 16-bit gray scaled."""
    from PIL import Image

    if image.mode in SIXTEEN_BIT_GRAY:
        values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        image = Image.fromarray(((2 * values + 257) // 514).astype(np.uint8))  # round(v / 257): 65535 -> 255
    elif image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # what convert("RGB") reads too, without Pillow's warning about it
    target = "L" if gray else "RGB"
    return image if image.mode == target else image.convert(target)
