"""The real-dataset path: torchvision's MNIST files under recipe.data.root are found and used.

This machine has no internet, so the test writes a small MNIST in torchvision's own raw
format (IDX files) from the synthetic generator (tests/helpers/mnist_files.py, through conftest's
``mnist_files``) and points recipe.data.root at it.
"""
from __future__ import annotations


def test_files_under_data_root_are_used_by_auto_and_by_mnist(mnist_files, two_ranks_on_mnist_files, train_here):
    # Two ranks with source=auto (rank 0 decides); one rank in this process with source=mnist.
    one = train_here([f"recipe.data.root={mnist_files}", "logger=none", "recipe.data.eval_batch_size=128",
                      "train.max_steps=5", "recipe.data.source=mnist"])
    for done in (two_ranks_on_mnist_files, one):
        assert done.returncode == 0, done.stderr[-3000:]
        results = done.results()
        assert results["data_source"] == "mnist"
        assert results["final/eval_samples"] == 300  # the files' test set, every sample once
        assert "SYNTHETIC" not in done.stderr
