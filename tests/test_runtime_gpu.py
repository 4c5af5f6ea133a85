"""More ranks on a machine than GPUs: the README's two-process command on a one-GPU machine."""
from __future__ import annotations

import pytest

from helpers.availability import cuda_count
from helpers.launches import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 1, reason="needs a CUDA GPU")]


def test_more_ranks_than_gpus_train_on_the_cpu_and_say_how_to_use_the_gpus(out):
    ranks = cuda_count() + 1
    done = launch(["experiment=debug", "logger=none"], out, nproc=ranks, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout + done.stderr
    assert text.count(f"{ranks} ranks on this machine but {ranks - 1} GPU(s): training on the CPU") == 1, text
    assert f"--nproc_per_node={ranks - 1}" in text
    res = done.results()
    assert res["world_size"] == ranks and res["mode"] == "eager" and len(set(res["param_digests"])) == 1


def test_device_cuda_with_more_ranks_than_gpus_names_the_fix(out):
    ranks = cuda_count() + 1
    done = launch(["experiment=debug", "logger=none", "device=cuda"], out, nproc=ranks, timeout=300)
    assert done.returncode != 0
    assert f"set torchrun --nproc_per_node={ranks - 1}" in done.stdout + done.stderr
