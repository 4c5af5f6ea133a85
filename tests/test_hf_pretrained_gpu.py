"""Pretrained models in and out on GPUs (issue 51's GPU checks at a small size): a save_pretrained directory read
straight into FSDP2 shards on two GPUs evaluates as the same directory loaded whole under DDP; trained with
graph=full and written out at the run's end from the shards (checkpoint.export), it reloads in transformers with
the run's final weights.

Run on the GPU machine: ``pytest -m gpu tests/test_hf_pretrained_gpu.py``. Skipped without two CUDA GPUs or
without transformers. The CPU versions (gloo) are in tests/test_hf_causal_lm.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers.availability import cuda_count, needs_extra
from helpers.launches import launch

pytestmark = [pytest.mark.gpu, pytest.mark.extras, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 GPUs")]
transformers = needs_extra("transformers")

LLAMA = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=256, max_position_embeddings=128)
COMMON = ["recipe=hf_causal_lm", "experiment=debug", "logger=none", "train.progress=false", "recipe.model.config=null",
          "recipe.model.context=128", "recipe.data.train_size=1024", "recipe.data.test_size=96",
          "recipe.data.batch_size=16", "recipe.data.eval_batch_size=32", "train.precision=bf16"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pretrained") / "llama"
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA))
    model.to(torch.bfloat16).save_pretrained(directory)  # bf16 files, as checkpoints on the Hub are
    return directory


def _eval(done) -> dict:
    assert done.returncode == 0, done.output[-4000:]
    return json.loads((done.run_dir / "eval.json").read_text())


def test_a_pretrained_directory_read_into_shards_on_two_gpus_evaluates_as_loaded_whole(out, source):
    args = [*COMMON, f"recipe.model.path={source}", "train.eval_only=true"]
    sharded = _eval(launch([*args, "train.parallel=fsdp2", "train.fsdp.init=meta", "graph=full"], out / "meta",
                           nproc=2, timeout=300))
    whole = _eval(launch([*args, "graph=full"], out / "host", nproc=2, timeout=300))
    assert set(sharded["param_digests"]) == set(whole["param_digests"])  # the very same fp32 weights
    assert sharded["final/eval_loss"] == pytest.approx(whole["final/eval_loss"], rel=2e-2)  # bf16 autocast


def test_a_run_trained_with_graphs_writes_its_model_from_its_shards_and_transformers_reads_it_back(out, source,
                                                                                                 tmp_path):
    exported = tmp_path / "trained"
    done = launch([*COMMON, f"recipe.model.path={source}", "train.parallel=fsdp2", "train.fsdp.init=meta",
                   "graph=full", "train.max_steps=20", "train.log_every=5", "checkpoint.save=false",
                   f"checkpoint.export={exported}"], out / "train", nproc=2, timeout=300)
    assert done.returncode == 0, done.output[-4000:]
    results = done.results()
    assert results["timed_phase"] == "graph" and f"exported the trained model to {exported} in " in done.output
    reloaded = _eval(launch([*COMMON, f"recipe.model.path={exported}", "train.eval_only=true"], out / "reloaded",
                            nproc=None, timeout=300))
    assert reloaded["param_digests"][0] == results["param_digests"][0]  # the run's final weights, exactly
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.use_cache and torch.isfinite(model(torch.randint(0, 256, (1, 16))).logits).all()
