"""Data from disk into a graphed step: a PNG folder and token files through the host
loader (DataLoader workers, pinned buffers) train exactly as the device loader does."""
from __future__ import annotations

import pytest
import torch

from helpers.availability import cuda_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]


def losses(done):
    return [r["train/loss"] for r in done.metrics() if "train/loss" in r]


def host_vs_device(train_here, tmp_path, args):
    runs = {}
    for loader in ("device", "host"):
        runs[loader] = train_here([*args, f"recipe.data.loader={loader}", "recipe.data.num_workers=2"],
                                  tmp_path / loader)
        assert runs[loader].returncode == 0, runs[loader].stderr[-3000:]
    device, host = runs["device"].results(), runs["host"].results()
    assert host["mode"] == device["mode"] == "full" and host["capture_error_mode"] == "global"
    return runs, device, host


def test_a_png_folder_through_the_host_loader_trains_as_the_device_loader_graphed(train_here, tmp_path):
    from scripts.export_images import main

    folder = tmp_path / "cifar_png"
    assert main(["recipe=cifar10_resnet18", "recipe.data.source=synthetic", "recipe.data.train_size=1024",
                 "recipe.data.test_size=256", "--output", str(folder)]) == 0
    args = ["recipe=cifar10_resnet18", "recipe.data.source=folder", f"recipe.data.root={folder}", "graph=full",
            "train.precision=bf16", "train.max_steps=40", "train.log_every=4", "recipe.data.batch_size=32",
            "deterministic=true", "logger=none"]
    runs, device, host = host_vs_device(train_here, tmp_path, args)
    config = runs["host"].run_dir.joinpath("config.yaml").read_text()
    assert "loader_used: host" in config and "memory_format_used: channels_last" in config
    assert losses(runs["host"]) == losses(runs["device"])  # the same batches, bit for bit
    assert host["param_digests"] == device["param_digests"]
    assert host["final/eval_samples"] == 256


def test_token_files_through_the_host_loader_train_as_the_device_loader_graphed(train_here, tmp_path):
    from recipes.gpt import synthetic_text
    from scripts.prepare_text import main

    text = tmp_path / "corpus.txt"
    text.write_bytes(synthetic_text(0, 200_000))
    main([str(text), "--output", str(tmp_path / "tokens")])
    args = ["recipe=gpt_tiny", "recipe.data.source=tokens", f"recipe.data.root={tmp_path / 'tokens'}",
            "recipe.model.n_layer=2", "recipe.model.d_model=128", "recipe.model.n_head=4", "recipe.model.context=128",
            "graph=full", "train.max_steps=40", "train.log_every=4", "deterministic=true", "logger=none"]
    runs, device, host = host_vs_device(train_here, tmp_path, args)
    assert losses(runs["host"]) == losses(runs["device"])
    assert host["param_digests"] == device["param_digests"]
    assert torch.isfinite(torch.tensor(losses(runs["host"]))).all()
