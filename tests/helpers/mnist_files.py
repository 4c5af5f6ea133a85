"""A small MNIST in torchvision's own raw format (IDX files), written from the synthetic generator: what the
real-dataset tests point recipe.data.root at (this machine has no internet to download MNIST)."""
from __future__ import annotations

import struct
from pathlib import Path

from recipes.mnist import synthetic_mnist


def write_idx_mnist(root: Path, train_size: int, test_size: int) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    train, test = synthetic_mnist(123, train_size, test_size)
    for prefix, split in (("train", train), ("t10k", test)):
        images = split.x[:, 0].numpy()
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, len(images), 28, 28)
                                                          + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, len(images))
                                                          + split.y.numpy().astype("uint8").tobytes())
