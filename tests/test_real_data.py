"""The real-dataset path: torchvision's MNIST files under recipe.data.root are found and used.

This machine has no internet, so the test writes a small MNIST in torchvision's own raw
format (IDX files) from the synthetic generator and points recipe.data.root at it.
"""
from __future__ import annotations

import struct
from pathlib import Path

from conftest import launch
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


def test_files_under_data_root_are_used_by_auto_and_by_mnist(tmp_path, out):
    write_idx_mnist(tmp_path / "data", 2048, 300)
    for source in ("auto", "mnist"):
        done = launch([f"recipe.data.source={source}", f"recipe.data.root={tmp_path / 'data'}", "logger=none",
                       "recipe.data.eval_batch_size=128", "train.max_steps=5", f"output_root={out / source}"],
                      out, nproc=2, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        results = next((out / source).rglob("results.json")).read_text()
        assert '"data_source": "mnist"' in results
        assert '"final/eval_samples": 300.0' in results  # the files' test set, every sample once
        assert "SYNTHETIC" not in done.stderr
