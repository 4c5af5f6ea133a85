"""Loss curves laid over each other in a small PNG, with no plotting library (none is a requirement here).

    write_loss_plot(path, [("torchtitan compiled", losses_a), ("this repo full_compiled", losses_b)])

Each curve is drawn in its own colour over the same axes (step on x, loss on y, both from the curves' own
range, the lowest loss at the bottom); grid lines mark tenths of the range. There is no text in the image:
the caller says which colour is which (``COLOURS`` names them in order) and the axes' ranges, which
``write_loss_plot`` returns.
"""
from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

COLOURS: List[Tuple[str, Tuple[int, int, int]]] = [
    ("blue", (31, 119, 180)), ("orange", (255, 127, 14)), ("green", (44, 160, 44)), ("red", (214, 39, 40)),
    ("purple", (148, 103, 189)), ("brown", (140, 86, 75)), ("pink", (227, 119, 194)), ("grey", (127, 127, 127)),
]
WIDTH, HEIGHT, MARGIN = 900, 520, 30
GRID, AXES, BACKGROUND = (225, 225, 225), (60, 60, 60), (255, 255, 255)


def write_loss_plot(path: Path, curves: Sequence[Tuple[str, Sequence[Optional[float]]]]) -> Dict[str, object]:
    """Draws ``curves`` (label, one loss per step from step 1; None or NaN where a step has none) into a PNG at
    ``path``; returns what the image cannot say: each label's colour and the axes' ranges."""
    points = [(i + 1, v) for _, losses in curves for i, v in enumerate(losses) if _finite(v)]
    if not points:
        raise ValueError("no finite loss to plot")
    x_max = max(x for x, _ in points)
    y_lo, y_hi = min(y for _, y in points), max(y for _, y in points)
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    pixels = bytearray(bytes(BACKGROUND) * (WIDTH * HEIGHT))
    inner_w, inner_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def at(x: float, y: float) -> Tuple[float, float]:
        px = MARGIN + (x - 1) / max(x_max - 1, 1) * inner_w
        py = MARGIN + (y_hi - y) / (y_hi - y_lo) * inner_h
        return px, py

    def put(px: int, py: int, colour) -> None:
        if 0 <= px < WIDTH and 0 <= py < HEIGHT:
            i = 3 * (py * WIDTH + px)
            pixels[i:i + 3] = bytes(colour)

    for k in range(11):
        gy, gx = MARGIN + round(k * inner_h / 10), MARGIN + round(k * inner_w / 10)
        for px in range(MARGIN, WIDTH - MARGIN + 1):
            put(px, gy, GRID)
        for py in range(MARGIN, HEIGHT - MARGIN + 1):
            put(gx, py, GRID)
    for px in range(MARGIN, WIDTH - MARGIN + 1):
        put(px, HEIGHT - MARGIN, AXES)
    for py in range(MARGIN, HEIGHT - MARGIN + 1):
        put(MARGIN, py, AXES)
    legend = {}
    for n, (label, losses) in enumerate(curves):
        name, colour = COLOURS[n % len(COLOURS)]
        legend[label] = name
        previous = None
        for i, v in enumerate(losses):
            if not _finite(v):
                previous = None
                continue
            point = at(i + 1, v)
            if previous is not None:
                _line(previous, point, colour, put)
            else:
                _line(point, point, colour, put)
            previous = point
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_png(pixels))
    return {"colours": legend, "steps": [1, x_max], "loss": [y_lo, y_hi]}


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def _line(a: Tuple[float, float], b: Tuple[float, float], colour, put) -> None:
    """A line two pixels thick from ``a`` to ``b``."""
    steps = max(int(max(abs(b[0] - a[0]), abs(b[1] - a[1]))), 1)
    for s in range(steps + 1):
        x = round(a[0] + (b[0] - a[0]) * s / steps)
        y = round(a[1] + (b[1] - a[1]) * s / steps)
        for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
            put(x + dx, y + dy, colour)


def _png(pixels: bytearray) -> bytes:
    rows = b"".join(b"\x00" + bytes(pixels[3 * WIDTH * y:3 * WIDTH * (y + 1)]) for y in range(HEIGHT))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b"")
