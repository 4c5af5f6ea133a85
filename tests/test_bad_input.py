"""Every bad input gets one clear message naming the setting, a non-zero exit, nothing half-written.

| input                                   | exit | message names                         |
|-----------------------------------------|------|---------------------------------------|
| recipe=nope                             | 1    | Could not find 'recipe/nope'          |
| train.epochz=3 (typo)                   | 1    | Key 'epochz' not in 'TrainLoopConfig' |
| train.epochs=many (wrong type)          | 1    | train.epochs                          |
| graph.capture_error_mode=sometimes      | 2    | graph.capture_error_mode + the three  |
| graph=full on a machine without CUDA    | 2    | graph.mode=full needs a CUDA GPU      |
| warmup_iters below 11 under DDP         | 2    | graph.warmup_iters (in-process check) |
| batch larger than a rank's shard        | 2    | recipe.data.batch_size                |
| data.source=mnist offline, no files     | 2    | recipe.data.source / recipe.data.root |
| unwritable output directory             | 2    | output_root / run_dir                 |
| zero or negative sizes                  | 2    | the key                               |
| unknown optimizer                       | 2    | recipe.optim.name                     |
| device=cuda without CUDA                | 2    | device                                |
"""
from __future__ import annotations

import pytest
import torch

from conftest import launch
from conf.schema import GraphConfig, GraphMode
from graphing.options import resolve_mode
from recipes.runtime import ConfigError

QUICK = ["recipe.data.source=synthetic", "recipe.data.train_size=2048", "recipe.data.test_size=256",
         "logger=none", "train.max_steps=2"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message seen without CUDA")

CASES = [
    pytest.param(["recipe=nope"], 1, ["Could not find 'recipe/nope'", "mnist"], id="unknown-recipe"),
    pytest.param(["train.epochz=3"], 1, ["Key 'epochz' not in 'TrainLoopConfig'"], id="typo"),
    pytest.param(["train.epochs=many"], 1, ["could not be converted to Integer", "train.epochs"], id="wrong-type"),
    pytest.param(["graph.capture_error_mode=sometimes"], 2,
                 ["graph.capture_error_mode='sometimes'", "global, thread_local, relaxed"], id="capture-error-mode"),
    pytest.param(["graph=full"], 2, ["graph.mode=full needs a CUDA GPU", "graph=eager"], id="graph-without-cuda",
                 marks=no_cuda),
    pytest.param(["device=cuda"], 2, ["device=cuda", "device=auto"], id="cuda-device-without-cuda", marks=no_cuda),
    pytest.param(["recipe.data.batch_size=5000"], 2, ["asks for 5000 samples per step on each rank", "1024 training samples", "lower recipe.data.batch_size"],
                 id="batch-larger-than-shard"),
    pytest.param(["train.epochs=0"], 2, ["train.epochs=0 must be at least 1"], id="zero-epochs"),
    pytest.param(["recipe.data.batch_size=-4"], 2, ["recipe.data.batch_size=-4"], id="negative-batch"),
    pytest.param(["recipe.optim.name=lamb"], 2, ["recipe.optim.name='lamb'", "sgd"], id="unknown-optimizer"),
    pytest.param(["graph.compile_model=true", "graph=eager"], 2, ["graph.compile_model=true"], id="compile-model-eager"),
]


def _combined(done) -> str:
    return done.stdout + done.stderr


@pytest.mark.parametrize("args,code,needles", CASES)
def test_bad_input_under_torchrun_is_reported_once(out, args, code, needles):
    done = launch([*QUICK, *args], out, nproc=2, timeout=120)
    text = _combined(done)
    assert done.returncode != 0
    first = needles[0]
    assert text.count(first) == 1, f"expected {first!r} exactly once in:\n{text[-3000:]}"
    for needle in needles[1:]:
        assert needle in text, text[-3000:]
    # torchrun's agent prints its own failure report; the ranks print no stack trace of ours.
    assert 'train.py", line' not in text and 'recipes/' not in text and 'graphing/' not in text
    assert not list(out.rglob("results.json")), "nothing half-written"


@pytest.mark.parametrize("args,code,needles", CASES[:4] + CASES[6:8])
def test_bad_input_exit_code_in_one_process(out, args, code, needles):
    done = launch([*QUICK, *args], out, timeout=120)
    assert done.returncode == code, _combined(done)[-3000:]
    assert needles[0] in _combined(done)


def test_mnist_requested_offline_without_files(out, tmp_path):
    # A closed local proxy makes this machine offline for the download, whatever its network.
    offline = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
               "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    done = launch(["recipe.data.source=mnist", f"recipe.data.root={tmp_path / 'empty'}", "logger=none"], out,
                  nproc=2, env=offline, timeout=180)
    text = _combined(done)
    assert done.returncode != 0
    assert text.count("recipe.data.source=mnist but mnist is not under recipe.data.root") == 1, text[-3000:]
    assert "recipe.data.source=synthetic" in text


def test_auto_source_falls_back_to_synthetic_with_one_warning(out, tmp_path):
    offline = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
               "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    done = launch(["recipe.data.source=auto", f"recipe.data.root={tmp_path / 'empty'}", "logger=none",
                   "recipe.data.train_size=2048", "recipe.data.test_size=256", "train.max_steps=2"], out,
                  nproc=2, env=offline, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _combined(done).count("training on SYNTHETIC data") == 1
    assert done.results()["data_source"] == "synthetic"


def test_unwritable_output_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = launch([*QUICK], blocker / "outputs", nproc=2, timeout=120)
    text = _combined(done)
    assert done.returncode != 0
    assert text.count("cannot write to the run directory") == 1, text[-3000:]
    assert "output_root=" in text


def _graph(**kw) -> GraphConfig:
    cfg = GraphConfig()
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_warmup_below_eleven_under_ddp_is_refused_with_the_reason():
    cuda = torch.device("cuda", 0)  # resolve_mode only reads the device type
    with pytest.raises(ConfigError, match=r"graph.warmup_iters=5 is too few under DDP.*first 10 iterations"):
        resolve_mode(_graph(mode=GraphMode.full, warmup_iters=5), cuda, world_size=2)
    assert resolve_mode(_graph(mode=GraphMode.full, warmup_iters=5), cuda, world_size=1) == "full"
    assert resolve_mode(_graph(mode=GraphMode.full, warmup_iters=11), cuda, world_size=2) == "full"


def test_auto_mode_picks_full_on_cuda_and_eager_on_cpu():
    assert resolve_mode(_graph(mode=GraphMode.auto), torch.device("cuda", 0), 2) == "full"
    assert resolve_mode(_graph(mode=GraphMode.auto), torch.device("cpu"), 2) == "eager"


def test_every_capture_error_mode_is_accepted_and_others_are_not():
    for mode in ("global", "thread_local", "relaxed"):
        assert resolve_mode(_graph(mode=GraphMode.full, capture_error_mode=mode), torch.device("cuda", 0), 2) == "full"
    with pytest.raises(ConfigError, match="global, thread_local, relaxed"):
        resolve_mode(_graph(capture_error_mode="Global"), torch.device("cpu"), 1)
