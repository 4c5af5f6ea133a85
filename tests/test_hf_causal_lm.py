"""recipe=hf_causal_lm: a Hugging Face transformers causal LM, from a config or a local directory.

Skipped where transformers is not installed (`pip install -r requirements-hf.txt`; CI does, after the
README's pytest, and runs `pytest -m extras`). The GPU checks
(graph=full against graph=eager for llama, qwen2 and gpt2) are tests/test_hf_causal_lm_gpu.py.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers.availability import needs_extra
from helpers.launches import launch, launch_together
from helpers.paths import ROOT

pytestmark = pytest.mark.extras
transformers = needs_extra("transformers")

# experiment=debug's tiny llama (conf/experiment_recipe/debug_hf_causal_lm.yaml) on fewer windows.
DEBUG = ["recipe=hf_causal_lm", "experiment=debug", "logger=none", "recipe.data.train_size=64",
         "recipe.data.test_size=32"]
TINY_LLAMA = dict(model_type="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=256, max_position_embeddings=64)


@pytest.mark.fast
def test_debug_experiment_trains_a_tiny_llama(train_here):
    done = train_here([*DEBUG, "train.max_steps=8", "train.log_every=4"])
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert (res["mode"], res["steps"]) == ("eager", 8) and "perf/tokens_per_s" in res
    assert math.isfinite(res["final/eval_loss"]) and res["final/eval_tokens"] == 32 * 64
    losses = [row["train/loss"] for row in done.metrics() if "train/loss" in row]
    assert len(losses) == 2 and losses[1] < losses[0] < math.log(256) + 0.2, losses  # it learns from chance
    config = (done.run_dir / "config.yaml").read_text()
    assert "model_type: llama" in config and "source_used: synthetic" in config


def test_two_gloo_ranks_train_and_the_checkpoint_resumes_on_one(out, train_here):
    args = [*DEBUG, "recipe.data.train_size=128", "train.log_every=2", "train.progress=false"]  # 8 steps an epoch
    first = launch([*args, "train.max_steps=4"], out, nproc=2, timeout=180)
    assert first.returncode == 0, first.output[-4000:]
    run_dir = first.run_dir
    assert first.results()["steps"] == 4 and (run_dir / "checkpoints" / "step_00000004.pt").is_file()

    # The same command asking for more steps, here in one process: it resumes the 2-rank checkpoint.
    again = train_here([*args, "train.max_steps=6", f"run_dir={run_dir}"], out)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004.pt'} at step 4" in again.stdout
    assert again.results()["steps"] == 6
    assert [row["step"] for row in again.metrics() if "train/loss" in row] == [2, 4, 6]  # appended, not restarted


@pytest.mark.fast
def test_a_local_pretrained_directory_loads_with_its_weights(train_here, tmp_path):
    from conf.schema import compose
    from recipes.gpt import language_data

    torch.manual_seed(1234)  # weights no run of seed 0 draws by itself
    saved = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA))
    saved.save_pretrained(tmp_path / "tiny_llama")

    # One step over a train split of exactly one batch: its mean loss is the whole split's, in any order.
    args = [*DEBUG, "recipe.model.config=null", f"recipe.model.path={tmp_path / 'tiny_llama'}",
            "recipe.data.train_size=8", "recipe.data.batch_size=8", "train.precision=fp32", "train.max_steps=1",
            "train.log_every=1"]
    done = train_here(args)
    assert done.returncode == 0, done.stderr[-3000:]
    first_loss = next(row["train/loss"] for row in done.metrics() if "train/loss" in row)

    cfg = compose(args)
    train = language_data(cfg.recipe.data, cfg.seed, context=64, vocab=256).train
    with torch.no_grad():
        logits = saved.eval()(train.x.long()).logits
    own = F.cross_entropy(logits.flatten(0, 1), train.y.flatten()).item()
    assert first_loss == pytest.approx(own, rel=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("overrides,message", [
    (["recipe.model.path=/some/model"], "recipe.model.config and recipe.model.path are both set"),
    (["recipe.model.config=null"], "neither recipe.model.config nor recipe.model.path is set"),
])
def test_config_and_path_together_or_neither_are_refused(train_here, overrides, message):
    done = train_here([*DEBUG, *overrides])
    assert done.returncode == 2 and message in done.stderr, done.stderr[-3000:]


@pytest.mark.fast
def test_without_transformers_the_recipe_says_what_to_install(train_here, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    done = train_here(DEBUG)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("pip install -r requirements-hf.txt") == 1, done.stderr
    assert "needs Hugging Face transformers" in done.stderr


@pytest.mark.fast
def test_settings_the_model_would_not_read_are_refused():
    from recipes.hf_causal_lm import ModelSettings, check_config, model_config, model_settings
    from trainer.run.errors import ConfigError

    long_context = ModelSettings(TINY_LLAMA, None, 128)
    with pytest.raises(ConfigError, match=r"recipe\.model\.config\.num_hiden_layers is not a setting of LlamaConfig.*"
                                        r"did you mean recipe\.model\.config\.num_hidden_layers\?"):
        model_config(ModelSettings({**TINY_LLAMA, "num_hiden_layers": 2}, None, 64), transformers)
    with pytest.raises(ConfigError, match=r"recipe\.model\.context=128 is longer than the model's "
                                        r"max_position_embeddings=64"):
        check_config(model_config(long_context, transformers), long_context)
    with pytest.raises(ConfigError, match=r"BertConfig with is_decoder=false"):
        check_config(transformers.AutoConfig.for_model("bert"), ModelSettings({"model_type": "bert"}, None, 64))
    with pytest.raises(ConfigError, match=r"recipe\.model\.width is not a setting of recipe\.model"):
        model_settings({"config": TINY_LLAMA, "context": 64, "width": 3})
    # A legacy key that the config class converts (rope_theta into rope_parameters) is read, not refused.
    model_config(ModelSettings({**TINY_LLAMA, "rope_theta": 5e5}, None, 64), transformers)


@pytest.mark.fast
def test_the_recipes_blocks_are_the_classes_the_model_names_unsplittable():
    from trainer.recipe import blocks_named

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA))
    blocks = blocks_named(model, model._no_split_modules)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    assert blocks[0] is model.model.layers[0]


@pytest.mark.fast
def test_its_decoder_layers_are_sharded_by_fsdp2_and_recomputed_by_activation_checkpointing(train_here, tmp_path):
    """The model's own _no_split_modules (two LlamaDecoderLayers) serve both, and neither changes the arithmetic."""
    import yaml

    args = [*DEBUG, "train.max_steps=3", "train.log_every=1", "train.precision=fp32"]
    runs = {name: train_here([*args, *extra], tmp_path / name) for name, extra in (
        ("plain", []), ("fsdp2", ["train.parallel=fsdp2"]), ("recomputed", ["train.activation_checkpointing=true"]))}
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    config = {name: yaml.safe_load((done.run_dir / "config.yaml").read_text()) for name, done in runs.items()}
    assert config["fsdp2"]["train"]["fsdp"]["blocks_used"] == 2
    assert config["recomputed"]["train"]["activation_checkpointing_used"] is True
    losses = {name: [row["train/loss"] for row in done.metrics() if "train/loss" in row] for name, done in runs.items()}
    assert len(losses["plain"]) == 3
    assert losses["recomputed"] == losses["plain"]  # the forward done twice, the same numbers
    assert losses["fsdp2"] == pytest.approx(losses["plain"], rel=1e-6)  # one rank: FSDP2 shards nothing away


def _meta_built_llama():
    """TINY_LLAMA as the recipe builds it under train.fsdp.init=meta, then allocated (``to_empty``), unsharded."""
    from recipes.hf_causal_lm import ModelSettings, build_model

    config = transformers.AutoConfig.for_model(**TINY_LLAMA)
    with torch.device("meta"):
        model = build_model(config, ModelSettings(TINY_LLAMA, None, 16), transformers)
    assert all(p.is_meta for p in model.parameters())
    return model.to_empty(device="cpu"), config


@pytest.mark.fast
def test_a_meta_built_model_is_drawn_by_transformers_own_initialization():
    from recipes.hf_causal_lm import ModelSettings, build_model, init_weights

    model, config = _meta_built_llama()
    torch.manual_seed(0)
    init_weights(model)
    host = build_model(config, ModelSettings(TINY_LLAMA, None, 16), transformers)
    rotary, host_rotary = model.model.rotary_emb, host.model.rotary_emb
    assert torch.equal(rotary.inv_freq, host_rotary.inv_freq)  # a buffer, recomputed rather than left as memory held
    for (name, p), (_, q) in zip(model.named_parameters(), host.named_parameters()):
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, q), name  # ones
        else:  # drawn with the config's initializer_range, as from_config draws them
            assert p.std().item() == pytest.approx(config.initializer_range, rel=0.25), name


@pytest.mark.fast
def test_a_meta_built_tensor_that_initialization_leaves_unwritten_is_refused_by_name():
    from recipes.hf_causal_lm import init_weights
    from trainer.run.errors import ConfigError

    model, _ = _meta_built_llama()
    model.model.register_buffer("stray_table", torch.empty(4))  # no _init_weights writes it
    with pytest.raises(ConfigError, match=r"train.fsdp.init=meta: LlamaForCausalLM's model.stray_table is not "
                                          r"written by transformers' initialization .* set train.fsdp.init=host"):
        init_weights(model)


def test_two_gloo_ranks_build_it_on_the_meta_device_shard_it_and_train(out):
    done = launch([*DEBUG, "recipe.data.train_size=128", "train.parallel=fsdp2", "train.fsdp.init=meta",
                   "train.max_steps=6", "train.log_every=1",
                   "train.progress=false", "train.eval=false", "checkpoint.save=false"], out, nproc=2, timeout=180)
    assert done.returncode == 0, done.output[-4000:]
    losses = [row["train/loss"] for row in done.metrics() if "train/loss" in row]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(256)) < 0.3, losses  # small random weights: about chance, never garbage
    assert losses[-1] < losses[0], losses
    import yaml

    assert yaml.safe_load((done.run_dir / "config.yaml").read_text())["train"]["fsdp"]["init"] == "meta"


TINY_GPT2 = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=64)


def pretrained(directory, config: dict, dtype=torch.bfloat16):
    """A save_pretrained directory of ``config`` with weights no run of seed 0 draws itself, in ``dtype``."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    model.to(dtype).save_pretrained(directory)
    return directory


def test_a_pretrained_directory_loads_into_shards_under_meta_as_whole_on_the_host(out, train_here, tmp_path):
    # Two gloo ranks build each model on the meta device, shard it, and read only their parts of its bf16
    # safetensors files; a DDP run loads the same directory whole with transformers. Their evaluations agree.
    dirs = {"llama": pretrained(tmp_path / "llama", TINY_LLAMA), "gpt2": pretrained(tmp_path / "gpt2", TINY_GPT2)}
    common = [*DEBUG, "recipe.model.config=null", "train.precision=fp32", "train.eval_only=true"]
    sharded = launch_together({name: [*common, f"recipe.model.path={d}", "train.parallel=fsdp2", "train.fsdp.init=meta"]
                               for name, d in dirs.items()}, out, nproc=2, timeout=180)
    for name, d in dirs.items():
        assert sharded[name].returncode == 0, sharded[name].output[-3000:]
        whole = train_here([*common, f"recipe.model.path={d}"], tmp_path / f"host_{name}")
        assert whole.returncode == 0, whole.stderr[-3000:]
        meta_eval = json.loads(next(sharded[name].output_root.rglob("eval.json")).read_text())
        host_eval = json.loads(next((tmp_path / f"host_{name}").rglob("eval.json")).read_text())
        assert math.isfinite(host_eval["final/eval_loss"]) and host_eval["final/eval_loss"] < math.log(256) + 1
        assert meta_eval["final/eval_loss"] == pytest.approx(host_eval["final/eval_loss"], rel=1e-5), name
        assert set(meta_eval["param_digests"]) == set(host_eval["param_digests"]), name  # the very same weights


@pytest.mark.fast
def test_what_a_sharded_load_cannot_read_is_refused_naming_the_path(train_here, tmp_path):
    from safetensors.torch import load_file, save_file

    meta = [*DEBUG, "recipe.model.config=null", "train.parallel=fsdp2", "train.fsdp.init=meta", "train.max_steps=1"]

    def refused(directory, message):
        done = train_here([*meta, f"recipe.model.path={directory}"], tmp_path / "out" / directory.name)
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.count(message) == 1 and str(directory) in done.stderr, done.stderr[-3000:]
        assert not list((tmp_path / "out" / directory.name).rglob("metrics.jsonl"))

    transformers.AutoConfig.for_model(**TINY_LLAMA).save_pretrained(tmp_path / "config_only")
    refused(tmp_path / "config_only", "holds no *.safetensors weights")
    lacking = pretrained(tmp_path / "lacking", TINY_LLAMA)
    weights = load_file(lacking / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, lacking / "model.safetensors",
              metadata={"format": "pt"})
    refused(lacking, "lacks 1 of the model's weights (model.norm.weight)")
    other_shape = pretrained(tmp_path / "other_shape", TINY_LLAMA)
    transformers.AutoConfig.for_model(**{**TINY_LLAMA, "intermediate_size": 96}).save_pretrained(other_shape)
    refused(other_shape, "in its files but (96, 32) in the model its config.json describes")
    truncated = pretrained(tmp_path / "truncated", TINY_LLAMA)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    refused(truncated, "cannot be read")


# Small models whose mask is causal and nothing else, and one whose mask is more (a sliding window of 8).
CAUSAL_CONFIGS = {
    "llama": TINY_LLAMA,
    "qwen2": dict(TINY_LLAMA, model_type="qwen2"),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=256,
                 bos_token_id=0, eos_token_id=0),
}
WINDOWED = dict(TINY_LLAMA, model_type="mistral", sliding_window=8)


def causal_mask_built(model, embeds):
    """What transformers' create_causal_mask returns for ``model`` on unpadded windows of ``embeds`` (its cache
    argument is ``past_key_values`` in 5.17, ``cache`` in later releases)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    batch, length = embeds.shape[:2]
    cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    return create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, **{cache: None},
                              position_ids=torch.arange(length, device=embeds.device).expand(batch, length))


def built_model(config_dict):
    from recipes.hf_causal_lm import ModelSettings, build_model

    torch.manual_seed(0)
    return build_model(transformers.AutoConfig.for_model(**config_dict), ModelSettings(config_dict, None, 32),
                       transformers).eval()


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(CAUSAL_CONFIGS))
def test_a_causal_model_attends_through_sdpa_with_no_mask_built_and_the_same_logits(name):
    """No mask at all (SDPA's is_causal, the flash path, in eager and captured steps alike) gives the logits of
    transformers' own SDPA given the causal mask whole."""
    from recipes.hf_causal_lm import CAUSAL_SDPA

    model = built_model(CAUSAL_CONFIGS[name])
    assert model.config._attn_implementation == CAUSAL_SDPA
    x = torch.randint(0, 256, (2, 32))
    assert causal_mask_built(model, model.get_input_embeddings()(x)) is None
    with torch.no_grad():
        ours = model(x).logits
        model.set_attn_implementation("sdpa")
        causal = torch.ones(32, 32, dtype=torch.bool).tril().expand(2, 1, 32, 32)
        stock = model(x, attention_mask=causal).logits  # a 4D mask: transformers passes it to SDPA as it is
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_a_model_whose_mask_is_more_than_causal_keeps_transformers_mask():
    from recipes.hf_causal_lm import plain_causal_mask

    model = built_model(WINDOWED)
    assert model.config._attn_implementation == "sdpa"  # the window needs the mask transformers builds
    x = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        windowed = model(x).logits
        model.set_attn_implementation("eager")
        assert torch.allclose(windowed, model(x).logits, atol=1e-5)  # the same window, another kernel
    qwen2_sliding = transformers.AutoConfig.for_model(**dict(TINY_LLAMA, model_type="qwen2", use_sliding_window=True,
                                                             sliding_window=8, max_window_layers=1))
    assert not plain_causal_mask(qwen2_sliding)
    assert plain_causal_mask(transformers.AutoConfig.for_model(**dict(TINY_LLAMA, model_type="qwen2")))


def export(run_dir, out, *more: str) -> "subprocess.CompletedProcess":
    import subprocess

    return subprocess.run([sys.executable, "scripts/export_hf.py", str(run_dir), "--out", str(out), *more], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def exported_tensors(directory) -> dict:
    """Every tensor of a save_pretrained directory's safetensors files, as stored."""
    from safetensors.torch import load_file

    return {name: t for path in sorted(directory.glob("*.safetensors")) for name, t in load_file(path).items()}


def test_a_trained_model_exports_to_a_directory_transformers_reloads_with_the_same_weights(out, train_here, tmp_path):
    # A tiny llama trained under DDP in one process (a one-file checkpoint) and a tiny gpt2 (its lm_head tied) under
    # fsdp2 on two gloo ranks, built on the meta device (every rank's shards): each exported, then read back.
    common = [*DEBUG, "train.precision=fp32", "train.max_steps=4", "train.eval=false"]
    gpt2 = ["recipe.model.config=null", f"recipe.model.path={pretrained(tmp_path / 'gpt2_source', TINY_GPT2)}"]
    llama = train_here(common, tmp_path / "llama")
    assert llama.returncode == 0, llama.stderr[-3000:]
    sharded = launch([*common, *gpt2, "train.parallel=fsdp2", "train.fsdp.init=meta"], out, nproc=2, timeout=180)
    assert sharded.returncode == 0, sharded.output[-3000:]
    (tmp_path / "gpt2_source" / "generation_config.json").write_text('{"max_new_tokens": 7}')
    for name, run_dir in (("llama", llama.run_dir), ("gpt2", sharded.run_dir)):
        exported = export(run_dir, tmp_path / f"{name}_hf")
        assert exported.returncode == 0, exported.stderr[-3000:]
        # It says what it cost: a tiny model's export is the interpreter, torch and transformers, well under 2 GiB.
        peak = float(exported.stdout.split("peak host memory ")[1].split(" GiB")[0])
        assert 0.05 < peak < 2.0, exported.stdout
        files = sorted(p.name for p in (tmp_path / f"{name}_hf").iterdir())
        assert files == (["config.json", "generation_config.json", "model.safetensors"] if name == "gpt2" else
                         ["config.json", "model.safetensors"]), files
        # config.json names the dtype the files hold (fp32), also where the source directory's said bfloat16
        # (gpt2's): transformers loads the weights in what it says.
        assert json.loads((tmp_path / f"{name}_hf" / "config.json").read_text())["dtype"] == "float32", name
        # The checkpoint's weights evaluated, and the exported directory loaded by transformers and evaluated:
        # the same digest of the weights and the same loss.
        checkpoint = sorted((run_dir / "checkpoints").iterdir())[-1]
        base = [*DEBUG, "train.precision=fp32", "train.eval_only=true"]
        from_checkpoint = train_here([*base, *(gpt2 if name == "gpt2" else []), f"checkpoint.init_from={checkpoint}"],
                                     tmp_path / f"{name}_ckpt_eval")
        from_export = train_here([*base, "recipe.model.config=null", f"recipe.model.path={tmp_path / f'{name}_hf'}"],
                                 tmp_path / f"{name}_hf_eval")
        assert from_checkpoint.returncode == 0 and from_export.returncode == 0, from_export.stderr[-3000:]
        a, b = (json.loads((run.run_dir / "eval.json").read_text()) for run in (from_checkpoint, from_export))
        assert a["param_digests"] == b["param_digests"], name
        assert b["final/eval_loss"] == pytest.approx(a["final/eval_loss"], rel=1e-6), name
    # The one-file checkpoint's own tensors against transformers' reload: equal logits, bit for bit in fp32.
    state = torch.load(sorted((llama.run_dir / "checkpoints").iterdir())[-1], weights_only=True)["model"]
    config = transformers.AutoConfig.from_pretrained(tmp_path / "llama_hf")  # the debug llama's (conf/experiment_recipe)
    mine = transformers.AutoModelForCausalLM.from_config(config).eval()
    mine.load_state_dict(state)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama_hf").eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, mine(ids).logits)


@pytest.mark.fast
@pytest.mark.parametrize("ranks", ["one process", "a process group"])
def test_an_export_larger_than_a_file_is_split_into_files_transformers_reads_through_their_index(
        ranks, tmp_path, monkeypatch):
    # recipes.hf_causal_lm.export_pretrained, files of at most EXPORT_FILE_BYTES (a bigger tensor alone in its own),
    # planned by huggingface_hub as save_pretrained plans them: written a file at a time by one process, or as each
    # rank's parts joined into whole files (a gloo group of one).
    from safetensors import safe_open

    from helpers.one_rank import group_of_one
    from recipes import hf_causal_lm

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA)).eval()
    limit = 40_000  # the embedding (256 x 32 fp32) alone is 32 KiB
    monkeypatch.setattr(hf_causal_lm, "EXPORT_FILE_BYTES", limit)
    with group_of_one("gloo") if ranks == "a process group" else contextlib.nullcontext():
        hf_causal_lm.export_pretrained(None, model, tmp_path / "out")
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [name for name in written if name.endswith(".safetensors")]
    count = len(shards)
    assert count >= 3 and written == sorted(["config.json", "model.safetensors.index.json",
                                             *(f"model-{i:05d}-of-{count:05d}.safetensors"
                                               for i in range(1, count + 1))]), written
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    held = {}
    for name in shards:  # each file holds what the index says, at most the limit unless one tensor alone
        with safe_open(str(tmp_path / "out" / name), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            held.update({k: name for k in f.keys()})
        nbytes = sum(4 * math.prod(shape) for shape in sizes)
        assert nbytes <= limit or len(sizes) == 1, (name, nbytes)
    assert held == index["weight_map"] and list(held) != [] and set(held) == set(model.state_dict())
    order = [int(index["weight_map"][k][6:11]) for k in model.state_dict()]
    assert order == sorted(order)  # in the state dict's order, as save_pretrained fills its files
    assert index["metadata"]["total_size"] == sum(4 * t.numel() for t in model.state_dict().values())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_an_export_in_bf16_holds_each_trained_weight_rounded_once_and_its_config_says_so(train_here, tmp_path):
    # checkpoint.export_dtype=bf16 at the end of a run and scripts/export_hf.py --dtype bf16 from its checkpoint
    # write the same bytes: the final fp32 weights, each rounded to bf16 once; transformers loads them as bf16.
    # Then export_pretrained from FSDP2 shards (a gloo group of one: each rank casts its own DTensor shards).
    from torch.distributed.fsdp import fully_shard

    from helpers.one_rank import group_of_one
    from recipes import hf_causal_lm

    done = train_here([*DEBUG, "train.precision=fp32", "train.max_steps=2", "train.eval=false",
                       f"checkpoint.export={tmp_path / 'at_end'}", "checkpoint.export_dtype=bf16"], tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    script = export(done.run_dir, tmp_path / "from_checkpoint", "--dtype", "bf16")
    assert script.returncode == 0, script.stderr[-3000:]
    final = torch.load(sorted((done.run_dir / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)["model"]
    names = []
    for directory in (tmp_path / "at_end", tmp_path / "from_checkpoint"):
        written = exported_tensors(directory)
        assert written and {t.dtype for t in written.values()} == {torch.bfloat16}, directory
        assert all(torch.equal(t, final[name].to(torch.bfloat16)) for name, t in written.items()), directory
        assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
        assert transformers.AutoModelForCausalLM.from_pretrained(directory).dtype == torch.bfloat16
        names.append(written.keys())
    assert names[0] == names[1]

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA))
    whole = {name: t.detach().clone() for name, t in model.state_dict().items()}
    with group_of_one("gloo"):
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        hf_causal_lm.export_pretrained(None, model, tmp_path / "sharded", dtype=torch.bfloat16)
    written = exported_tensors(tmp_path / "sharded")
    assert written.keys() == whole.keys() - set(hf_causal_lm.tied_names(model))
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, whole[name].to(torch.bfloat16))
               for name, t in written.items())


@pytest.mark.fast
def test_what_an_export_cannot_write_is_refused_naming_the_path(train_here, tmp_path, capsys):
    from scripts.export_hf import main as export_hf  # in this process: the fast tier launches nothing

    done = train_here([*DEBUG, "train.max_steps=1", "train.eval=false", "checkpoint.save=false"], tmp_path / "nockpt")
    assert done.returncode == 0, done.stderr[-3000:]
    for run_dir, out, message in ((done.run_dir, tmp_path / "new", "holds no checkpoint to export"),
                                  (done.run_dir, tmp_path, "exists: give a new directory"),
                                  (tmp_path, tmp_path / "new2", "is not a run directory")):
        with pytest.raises(SystemExit) as refused:
            export_hf([str(run_dir), "--out", str(out)])
        stderr = capsys.readouterr().err
        assert refused.value.code == 2 and stderr.count(message) == 1, stderr[-3000:]
        assert not (tmp_path / "new").exists()


def test_a_run_writes_its_trained_model_at_its_end_from_the_shards_without_a_checkpoint(out, train_here, tmp_path):
    # checkpoint.export with checkpoint.save=false: two gloo ranks under fsdp2 (meta, a pretrained gpt2 with its
    # lm_head tied and a generation config) write from their shards; one DDP process writes a tiny llama.
    source = pretrained(tmp_path / "gpt2_source", TINY_GPT2)
    (source / "generation_config.json").write_text('{"max_new_tokens": 7}')
    common = [*DEBUG, "train.precision=fp32", "train.max_steps=3", "train.eval=false", "checkpoint.save=false"]
    sharded = launch([*common, "recipe.model.config=null", f"recipe.model.path={source}", "train.parallel=fsdp2",
                      "train.fsdp.init=meta", f"checkpoint.export={tmp_path / 'gpt2_hf'}"], out, nproc=2, timeout=180)
    assert sharded.returncode == 0, sharded.output[-3000:]
    whole = train_here([*common, f"checkpoint.export={tmp_path / 'llama_hf'}"], tmp_path / "llama")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert f"exported the trained model to {tmp_path / 'llama_hf'} in " in whole.stdout
    for run in (sharded.output, whole.stdout):  # what it cost, said once (rank 0, the ranks' highest)
        assert run.count("peak host memory of a rank ") == 1, run[-3000:]
        assert 0.05 < float(run.split("peak host memory of a rank ")[1].split(" GiB")[0]) < 4.0, run[-3000:]
    for name, run in (("gpt2", sharded), ("llama", whole)):
        exported = tmp_path / f"{name}_hf"
        kept = sorted(p.name for p in exported.iterdir())
        assert "config.json" in kept and any(k.endswith(".safetensors") for k in kept) and "sharded" not in kept, kept
        assert ("generation_config.json" in kept) == (name == "gpt2") and not list(exported.parent.glob(".*.tmp"))
        assert json.loads((exported / "config.json").read_text())["dtype"] == "float32", name  # gpt2's source: bf16
        assert not list(run.run_dir.glob("checkpoints/*"))  # checkpoint.save=false: the export alone
        # transformers reads it, and it holds the run's final weights: their digest.
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
        assert reloaded.config.use_cache and (name != "gpt2" or reloaded.lm_head.weight is
                                              reloaded.transformer.wte.weight)
        evaluated = train_here([*DEBUG, "train.precision=fp32", "train.eval_only=true", "recipe.model.config=null",
                                f"recipe.model.path={exported}"], tmp_path / f"{name}_eval")
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        digest = json.loads((evaluated.run_dir / "eval.json").read_text())["param_digests"][0]
        assert digest == run.results()["param_digests"][0], name


@pytest.mark.fast
def test_an_export_into_an_existing_directory_or_from_a_recipe_without_one_is_refused(train_here, tmp_path):
    for overrides, message in (([*DEBUG, f"checkpoint.export={tmp_path}"], "exists: it holds a directory that no run's export wrote"),
                               (["recipe=mnist", "experiment=debug", "logger=none",
                                 f"checkpoint.export={tmp_path / 'new'}"], "recipe 'mnist' cannot write its model")):
        done = train_here([*overrides, "train.max_steps=1"], tmp_path / "out")
        assert done.returncode == 2 and done.stderr.count(message) == 1, done.stderr[-3000:]
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("layer_norm_bias", ["true", "false"])
def test_a_gpt_recipe_run_exports_as_gpt2_with_the_same_logits(train_here, tmp_path, layer_norm_bias):
    # The gpt recipes are GPT-2's layout: exported as transformers' GPT2LMHeadModel (Conv1D weights transposed,
    # the biases this model trains without written as zeros), reloaded, the same logits to float rounding.
    import yaml

    from recipes.gpt import GPT, model_config

    done = train_here(["recipe=gpt_tiny", "experiment=debug", "logger=none", "train.max_steps=2", "train.eval=false",
                       "train.precision=fp32", f"+recipe.model.layer_norm_bias={layer_norm_bias}"], tmp_path / "gpt")
    assert done.returncode == 0, done.stderr[-3000:]
    exported = export(done.run_dir, tmp_path / "gpt2_hf")
    assert exported.returncode == 0 and "(1 tied, written once: lm_head.weight)" in exported.stdout, exported.stderr
    mine = GPT(model_config(yaml.safe_load((done.run_dir / "config.yaml").read_text())["recipe"]["model"])).eval()
    mine.load_state_dict(torch.load(sorted((done.run_dir / "checkpoints").iterdir())[-1], weights_only=True)["model"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2_hf").eval()
    assert type(reloaded).__name__ == "GPT2LMHeadModel" and reloaded.lm_head.weight is reloaded.transformer.wte.weight
    ids = torch.randint(0, mine.config.vocab, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, mine(ids), rtol=1e-5, atol=1e-5)
    mnist = train_here(["recipe=mnist", "experiment=debug", "logger=none", "train.max_steps=1", "train.eval=false"],
                       tmp_path / "mnist")
    refused = export(mnist.run_dir, tmp_path / "mnist_hf")
    assert refused.returncode == 2 and "has no transformers class mapped here" in refused.stderr, refused.stderr


def test_the_pretrained_benchmark_loads_trains_exports_and_reloads_the_directory_it_writes(tmp_path):
    """scripts/bench_pretrained.py (issue 51's 8B rows) at a tiny size on two gloo ranks: it writes a random bf16
    save_pretrained directory, loads it whole on the host and straight into FSDP2 shards with the same losses,
    exports the trained model from the shards, and transformers reads the export back; its table and JSON say so."""
    table = tmp_path / "pretrained.json"
    done = launch(["--size", "tiny", "--nproc", "2", "--steps", "3", "--seq-len", "64", "--compare-host", "--reload",
                   "--work", str(tmp_path / "work"), "--output", str(table), "--", "graph=eager"],
                  script=str(ROOT / "scripts" / "bench_pretrained.py"), timeout=240)
    assert done.returncode == 0, done.output[-4000:]
    record = json.loads(table.read_text())
    host, meta = record["runs"]
    assert (host["init"], meta["init"]) == ("host", "meta") and len(meta["losses"]) == 3
    assert record["same_first_loss"] is True and meta["losses"] == pytest.approx(host["losses"], rel=1e-6)  # CPU: all
    assert record["written"]["files"] == 1 and record["written"]["bytes"] == 2 * record["parameters"]
    source = tmp_path / "work" / "source_tiny"
    assert json.loads((source / "config.json").read_text())["hidden_size"] == 64
    assert (tmp_path / "work" / "export" / "config.json").is_file() and "export_s" in meta and "export_s" not in host
    assert 0 < meta["peak_host_gib_any_rank"] and meta["startup_s"] > 0 and meta["first_step_s"] > 0
    assert record["reload"]["same_layout"] is True and record["reload"]["finite_logits"] is True
    assert record["reload"]["parameters"] == record["parameters"]
    markdown = table.with_suffix(".md").read_text()
    assert "| meta (train.fsdp.init=meta) |" in markdown and "meta's first loss is host's: True" in markdown
