"""scripts/bench_torchtitan.py, this repo against torchtitan on Llama 3 8B and 1B (issue 40), on the CPU.

A user gets one line and exit 2 for a bad option, and without torchtitan the command that installs it, before
anything looks for a GPU. Both sides train the same shape: torchtitan 0.2.2's 8B flavour (8.03e9 parameters)
and the 1B shape, as this repo's hf_causal_lm config, with one FLOP formula for both sides' MFU, the one each
trainer logs. ``--dry-run`` prints both sides' commands with the matched settings; no torchtitan or GPU needed.
Where transformers (an extra) or torchtitan is installed, their own models are built on the meta device and
counted against the formula.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shlex
import pytest

from helpers.availability import needs_extra
from helpers.launches import launch
from helpers.paths import ROOT
from scripts.lib.llama3 import (
    SHAPES, embedding_parameters, ffn_hidden_size, hf_config, mfu_pct, parameter_count,
    training_flops_per_token,
)

import scripts.bench_torchtitan as bench  # noqa: E402  (a test may import a script; scripts do not)

HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
SCRIPT = str(ROOT / "scripts" / "bench_torchtitan.py")


def plan(size: str = "8b", nproc: int = 2, ac: str = "full", steps: int = 20) -> "bench.Plan":
    return bench.Plan(SHAPES[size], nproc=nproc, seq_len=8192, local_batch=1, warmup_steps=12, steps=steps, ac=ac)


# ---- the command line ------------------------------------------------------------------

BAD = [  # (arguments, words of the one line)
    (["--size", "3b"], "argument --size: invalid choice: '3b'"),
    (["--nproc", "0"], "--nproc 0: must be at least 1"),
    (["--nproc", "-2"], "--nproc -2: must be at least 1"),
    (["--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
    (["--seq-len", "abc"], "argument --seq-len: 'abc' is not a positive integer"),
    (["--seq-len", "0"], "argument --seq-len: '0' is not a positive integer"),
    (["--seq-len", "-8192"], "argument --seq-len: '-8192' is not a positive integer"),
    (["--seq-len", "8.5"], "argument --seq-len: '8.5' is not a positive integer"),
    (["--local-batch", "0"], "argument --local-batch: '0' is not a positive integer"),
    (["--warmup-steps", "5"], "--warmup-steps 5: must be at least 12"),
    (["--ours", "compile"], "--ours 'compile': choose from full, full_compiled"),
    (["--theirs", "eager,fast"], "--theirs 'eager,fast': choose from eager, compiled"),
    (["--ours", "none", "--theirs", "none"], "nothing to run"),
    (["--profile", "-3"], "--profile -3: a number of steps, 0 for no profile"),
    (["--", "train.parallel=ddp"], "'train.parallel=ddp' is set by this script"),
    (["--", "recipe.model.config.hidden_size=8"], "'recipe.model.config.hidden_size=8' is set by this script"),
    (["--", "recipe=gpt_tiny"], "'recipe=gpt_tiny' is set by this script"),
    (["--", "train.fsdp.reshard_after_forward=false"], "'train.fsdp.reshard_after_forward=false' is set by this script"),
    (["--", "train.fsdp.root=split"], "'train.fsdp.root=split' is set by this script"),
    (["--reshard", "sometimes"], "argument --reshard: invalid choice: 'sometimes'"),
    (["--", "train.epochz=3"], "Key 'epochz' not in 'TrainLoopConfig'"),
    (["--repeats", "0"], "argument --repeats: '0' is not a positive integer"),
    (["--global-batch", "8"], "--global-batch is the batch of a --strong-scaling series"),
    (["--strong-scaling", "--local-batch", "2"], "--strong-scaling splits --global-batch over the GPUs"),
    (["--strong-scaling", "--nproc", "1"], "--strong-scaling with --nproc 1 is a single run"),
]


@pytest.mark.fast
@pytest.mark.parametrize("args,words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_option_is_one_line_and_exit_2(args, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--dry-run", *args])
    out, err = capsys.readouterr()
    assert stopped.value.code == 2, err
    assert err.splitlines() == [err.strip()] and err.startswith("bench_torchtitan.py: "), err
    assert words in err and "Traceback" not in err and not out


@pytest.mark.skipif(HAVE_TORCHTITAN, reason="checks the refusal where torchtitan is not installed")
def test_without_torchtitan_it_says_how_to_install_it_before_looking_for_cuda():
    proc = launch(["--nproc", "2"], script=SCRIPT, timeout=60, env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    message = "".join(line for line in proc.stderr.splitlines(keepends=True) if not line.startswith("import time:"))
    assert proc.returncode == 2, message  # a refusal (scripts/lib/refuse.py), not a crash (1)
    assert message.splitlines() == [message.strip()] and not proc.stdout
    assert "pip install -r scripts/requirements-torchtitan.txt" in message
    assert "pip download --no-deps -d wheels -r scripts/requirements-torchtitan.txt" in message and "--no-index" in message  # no index
    assert "CUDA" not in message and "GPU" not in message
    # Nothing looked for CUDA: that needs torch, which this run never imported.
    assert "argparse" in imported and not {m for m in imported if m == "torch" or m.startswith("torch.")}


@pytest.mark.skipif(HAVE_TORCHTITAN, reason="checks the refusal where torchtitan is not installed")
def test_with_this_repos_side_alone_it_needs_no_torchtitan_but_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    proc = launch(["--theirs", "none", "--nproc", "2"], script=SCRIPT, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("bench_torchtitan.py: both sides train on CUDA GPUs and this machine has none "
                                   "(--dry-run prints what would run)")


# ---- the shapes, their counts and the FLOP formula ---------------------------------------

@pytest.mark.fast
def test_the_shapes_are_torchtitans_8b_and_the_stated_1b():
    eight, one = SHAPES["8b"], SHAPES["1b"]
    assert (eight.dim, eight.layers, eight.heads, eight.kv_heads, eight.vocab, eight.rope_theta, eight.flavour) == \
        (4096, 32, 32, 8, 128256, 500000.0, "8B")
    assert (one.dim, one.layers, one.heads, one.kv_heads, one.vocab, one.rope_theta, one.flavour) == \
        (2048, 16, 32, 8, 128256, 500000.0, None)
    # torchtitan's feed-forward rule, checked on Llama 3's published sizes: 8B 14336, 70B 28672, 405B 53248.
    assert (eight.ffn_hidden, one.ffn_hidden) == (14336, 8192)
    assert ffn_hidden_size(8192, 1.3, 4096) == 28672 and ffn_hidden_size(16384, 1.2, 4096) == 53248
    # By hand: embedding + 32 x (q 4096^2 + k, v 4096 x 1024 + o 4096^2 + 3 x 4096 x 14336 + 2 norms) + norm + head.
    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert parameter_count(eight) == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248
    assert parameter_count(one) == 1_498_482_688
    assert embedding_parameters(eight) == 525_336_576


@pytest.mark.fast
def test_one_flop_formula_six_n_plus_the_attention_term():
    eight = SHAPES["8b"]
    dense = 6 * (8_030_261_248 - 128256 * 4096)
    attention = 12 * 32 * 4096 * 8192
    assert training_flops_per_token(eight, 8192) == dense + attention == 57_914_449_920
    assert training_flops_per_token(eight, 4096) == dense + attention // 2
    assert training_flops_per_token(SHAPES["1b"], 2048) == 6 * (1_498_482_688 - 128256 * 2048) + 12 * 16 * 2048 * 2048
    # MFU: a GPU training 4096 tokens/s of 8B at T=8192 against a 989 TFLOP/s peak (trainer/metrics/perf.py's H100/H200 SXM).
    assert mfu_pct(4096, 57_914_449_920, 989.0) == pytest.approx(100 * 4096 * 57_914_449_920 / 989e12)
    assert mfu_pct(4096, 57_914_449_920, 989.0) == pytest.approx(23.985, abs=1e-3)


@pytest.mark.fast
@pytest.mark.parametrize("size,ac", [("8b", "full"), ("1b", "none")])
def test_this_repos_side_composes_the_same_shape_and_matched_settings(size, ac):
    from omegaconf import OmegaConf

    from conf.schema import compose

    p = plan(size, nproc=4, ac=ac, steps=30)
    cfg = compose([*bench.ours_overrides(p), "graph=full_compiled"])
    model = OmegaConf.to_container(cfg.recipe.model, resolve=True)
    assert model["config"] == hf_config(SHAPES[size]) and model["path"] is None and model["context"] == 8192
    config = model["config"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"], config["vocab_size"]) == \
        (SHAPES[size].dim, SHAPES[size].layers, SHAPES[size].ffn_hidden, 128256)
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}
    assert config["tie_word_embeddings"] is False
    t = cfg.train
    assert (t.parallel.value, t.precision.value, t.fsdp.reduce_dtype.value, t.fsdp.reshard_after_forward) == \
        ("fsdp2", "bf16", "fp32", True)
    assert t.activation_checkpointing is (ac == "full")
    assert (t.max_steps, t.grad_clip, t.grad_accum, t.log_every, t.eval) == (42, 1.0, 1, 1, False)
    assert cfg.graph.warmup_iters == 11 and cfg.graph.compile_model is True
    data = cfg.recipe.data
    assert (data.source, data.batch_size, data.train_size, data.drop_last) == ("synthetic", 1, 4 * 42, True)
    optim = OmegaConf.to_container(cfg.recipe.optim)
    assert optim == {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 3e-4, "betas": [0.9, 0.95],
                     "weight_decay": 0.1, "eps": 1e-8}
    assert OmegaConf.to_container(cfg.recipe.schedule) == {"_target_": "trainer.step.schedules.Constant",
                                                           "_partial_": True, "warmup_steps": 10}
    assert cfg.recipe.accuracy is False and cfg.checkpoint.save is False


@pytest.mark.extras
@pytest.mark.parametrize("size", ["8b", "1b"])
def test_transformers_builds_each_shape_with_these_counts(size):
    needs_extra("transformers")
    import torch
    from omegaconf import OmegaConf

    from conf.schema import compose
    from recipes import hf_causal_lm

    cfg = compose(bench.ours_overrides(plan(size)))
    settings = hf_causal_lm.model_settings(cfg.recipe.model)
    config = hf_causal_lm.model_config(settings, hf_causal_lm.transformers_module())  # every key read, none a typo
    hf_causal_lm.check_config(config, settings)
    with torch.device("meta"):
        model = hf_causal_lm.transformers_module().AutoModelForCausalLM.from_config(config)
    shape = SHAPES[size]
    assert sum(p.numel() for p in model.parameters()) == parameter_count(shape)
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (shape.ffn_hidden, shape.dim)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (shape.kv_heads * shape.head_dim, shape.dim)
    # What results.json's MFU uses for this recipe, and the formula here: the same number.
    assert hf_causal_lm.training_flops_per_token(model, 8192) == training_flops_per_token(shape, 8192)
    assert OmegaConf.to_container(cfg.recipe.model.config)["rope_parameters"]["rope_type"] == "llama3"


@pytest.mark.skipif(not HAVE_TORCHTITAN, reason="needs torchtitan: pip install -r scripts/requirements-torchtitan.txt")
@pytest.mark.parametrize("size", ["8b", "1b"])
def test_torchtitan_builds_each_shape_with_these_counts(size):
    import torch
    from torchtitan.models.llama3 import Transformer

    from scripts.lib.torchtitan_worker import model_args_of

    shape = SHAPES[size]
    args = model_args_of(shape)
    with torch.device("meta"):
        model = Transformer(args)
    assert args.get_nparams_and_flops(model, 8192) == (parameter_count(shape), training_flops_per_token(shape, 8192))
    assert model.layers["0"].feed_forward.w1.weight.shape == (shape.ffn_hidden, shape.dim)


@pytest.mark.skipif(not HAVE_TORCHTITAN, reason="needs torchtitan: pip install -r scripts/requirements-torchtitan.txt")
def test_torchtitans_job_config_holds_the_matched_settings(tmp_path):
    from scripts.lib.torchtitan_worker import job_config, parse

    args = parse(["--size", "8b", "--seq-len", "8192", "--local-batch", "1", "--warmup-steps", "12", "--steps", "20",
                  "--ac", "full", "--compile", "--output", str(tmp_path / "r.json")])
    job = job_config(args, str(tmp_path), cuda=True)
    t = job.training
    assert (t.seq_len, t.local_batch_size, t.steps, t.max_norm) == (8192, 1, 32, 1.0)
    assert (t.dtype, t.mixed_precision_param, t.mixed_precision_reduce) == ("float32", "bfloat16", "float32")
    assert (job.activation_checkpoint.mode, job.compile.enable, job.compile.components) == ("full", True,
                                                                                            ["model", "loss"])
    o = job.optimizer
    assert (o.name, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.implementation) == \
        ("AdamW", 3e-4, 0.9, 0.95, 1e-8, 0.1, "fused")
    assert (job.lr_scheduler.warmup_steps, job.lr_scheduler.decay_ratio) == (10, 0.0)  # then constant
    assert (job.parallelism.data_parallel_shard_degree, job.parallelism.fsdp_reshard_after_forward) == (-1, "default")
    # Profiled steps past the timed ones are steps of its schedule too (past training.steps it would fail).
    profiled = parse(["--size", "1b", "--seq-len", "8192", "--local-batch", "1", "--warmup-steps", "12", "--steps", "20",
                      "--ac", "none", "--profile-steps", "4", "--output", str(tmp_path / "r.json")])
    assert job_config(profiled, str(tmp_path), cuda=True).training.steps == 36
    never = parse(["--size", "1b", "--seq-len", "8192", "--local-batch", "1", "--warmup-steps", "12", "--steps", "20",
                   "--ac", "none", "--reshard", "never", "--output", str(tmp_path / "r.json")])
    assert job_config(never, str(tmp_path), cuda=True).parallelism.fsdp_reshard_after_forward == "never"
    # --float8: its docs/float8.md settings (its 8B toml's float8 block).
    float8 = job_config(parse(["--size", "1b", "--seq-len", "8192", "--local-batch", "1", "--warmup-steps", "12",
                               "--steps", "20", "--ac", "none", "--float8", "--output", str(tmp_path / "r.json")]),
                        str(tmp_path), cuda=True)
    q = float8.quantize.linear.float8
    assert float8.model.converters == ["quantize.linear.float8"] and q.filter_fqns == ["output"]
    assert q.enable_fsdp_float8_all_gather and q.precompute_float8_dynamic_scale_for_fsdp
    assert job.model.converters == []  # without it: none


@pytest.mark.skipif(not HAVE_TORCHTITAN, reason="needs torchtitan: pip install -r scripts/requirements-torchtitan.txt")
@pytest.mark.parametrize("size", ["8b", "1b"])
def test_both_sides_rotate_with_the_same_frequencies(size):
    needs_extra("transformers")
    from torchtitan.models.llama3.model.model import precompute_freqs_cis
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from scripts.lib.torchtitan_worker import model_args_of

    shape = SHAPES[size]
    args = model_args_of(shape)
    theirs = precompute_freqs_cis(shape.head_dim, 2, args.rope_theta, args.rope_scaling_args).angle()[1]
    ours, scale = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(**hf_config(shape)), "cpu")
    assert scale == 1.0 and ours.shape == theirs.shape == (shape.head_dim // 2,)
    assert ours.float().allclose(theirs, rtol=1e-5, atol=1e-7)


# ---- --dry-run: both sides' commands ---------------------------------------------------------

@pytest.fixture(scope="module")
def dry_run():
    """``--dry-run`` as a user runs it, here without torchtitan or a GPU: {(size, side run): argument list}."""
    proc = launch(["--dry-run", "--nproc", "4", "--steps", "30", "--reshard", "never", "--",
                   "graph.capture_error_mode=thread_local"],
                  script=SCRIPT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^(8b|1b) (torchtitan \w+|this repo \w+): (.*)$", proc.stdout, flags=re.M)
    return proc.stdout, {(size, run): shlex.split(cmd) for size, run, cmd in lines}


def options(argv):
    """``--flag value`` pairs (and lone flags as True) of a worker command line."""
    out = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "=" not in arg:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = True if nxt is None or nxt.startswith("--") else nxt
    return out


def overrides(argv):
    """train.py's overrides of a command line: {key: value}."""
    after = argv[argv.index("train.py") + 1:]
    return dict(arg.split("=", 1) if "=" in arg else (arg, None) for arg in after)


def test_dry_run_prints_every_run_of_both_sides(dry_run):
    text, runs = dry_run
    assert set(runs) == {(size, run) for size in ("8b", "1b") for run in
                         ("torchtitan eager", "torchtitan compiled", "this repo full", "this repo full_compiled")}
    assert "8,030,261,248 parameters, 57,914,449,920 FLOPs per token at 8192" in text
    assert "1,498,482,688 parameters" in text
    assert "| activation checkpointing | activation_checkpoint.mode=full (every block) | " \
           "train.activation_checkpointing=true (every block) |" in text  # the matched settings, 8b's


@pytest.mark.parametrize("size,ac", [("8b", "full"), ("1b", "none")])
def test_dry_run_commands_hold_the_same_settings_on_both_sides(dry_run, size, ac):
    _, runs = dry_run
    workers = {}
    for variant in ("eager", "compiled"):
        argv = runs[size, f"torchtitan {variant}"]
        assert argv[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m"]
        assert argv[6] == "scripts.lib.torchtitan_worker"
        worker = options(argv)
        assert (worker["--size"], worker["--seq-len"], worker["--local-batch"], worker["--ac"]) == \
            (size, "8192", "1", ac)
        assert (worker["--warmup-steps"], worker["--steps"]) == ("12", "30")
        assert ("--compile" in argv) is (variant == "compiled")
        workers[variant] = worker
    assert {k: v for k, v in workers["eager"].items() if k not in ("--output",)} == \
        {k: v for k, v in workers["compiled"].items() if k not in ("--output", "--compile")}  # compile alone differs
    worker = workers["eager"]
    for mode in ("full", "full_compiled"):
        argv = runs[size, f"this repo {mode}"]
        assert argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
        ours = overrides(argv)
        assert ours["graph"] == mode and ours["recipe"] == "hf_causal_lm" and ours["recipe.model.config"] == "null"
        shape = SHAPES[size]
        assert f"hidden_size:{shape.dim},num_hidden_layers:{shape.layers}" in ours["+recipe.model.config"]
        assert f"intermediate_size:{shape.ffn_hidden},vocab_size:128256" in ours["+recipe.model.config"]
        # The same tokens per GPU, steps, activation checkpointing and numerics as the worker's.
        assert (ours["recipe.model.context"], ours["recipe.data.batch_size"]) == (worker["--seq-len"],
                                                                               worker["--local-batch"])
        assert int(ours["train.max_steps"]) == int(worker["--warmup-steps"]) + int(worker["--steps"]) == 42
        assert ours["graph.warmup_iters"] == "11"  # 11 eager + the capture = the worker's 12 untimed steps
        assert ours["train.activation_checkpointing"] == ("true" if ac == "full" else "false")
        assert (ours["train.parallel"], ours["train.precision"], ours["train.fsdp.reduce_dtype"]) == \
            ("fsdp2", "bf16", "fp32")
        assert ours["recipe.data.source"] == "synthetic" and ours["logger"] == "none"
        assert ours["train.fsdp.reshard_after_forward"] == "false" and worker["--reshard"] == "never"  # --reshard never
        assert argv[-4].startswith("output_root=") and argv[-6] == "graph.capture_error_mode=thread_local"  # the user's


def test_dry_run_with_float8_asks_both_sides_for_tensorwise_float8_with_its_all_gather():
    proc = launch(["--dry-run", "--nproc", "2", "--size", "1b", "--float8"], script=SCRIPT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^1b (torchtitan \w+|this repo \w+): (.*)$", proc.stdout, flags=re.M)
    assert len(lines) == 4, proc.stdout[-3000:]
    for run, line in lines:
        argv = shlex.split(line)
        if run.startswith("torchtitan"):
            assert options(argv)["--float8"] is True
        else:
            ours = overrides(argv)
            assert (ours["train.float8"], ours["train.fsdp.float8_all_gather"]) == ("tensorwise", "true")
    assert "| float8 | model.converters=quantize.linear.float8 (tensorwise)" in proc.stdout
    plain = launch(["--dry-run", "--nproc", "2", "--size", "1b"], script=SCRIPT, timeout=60)
    assert "--float8" not in plain.stdout and "train.float8=tensorwise" not in plain.stdout


def gpus(argv):
    """The processes a command line starts: torchrun's --nproc_per_node, or 1 for python alone."""
    return next((int(a.split("=")[1]) for a in argv if a.startswith("--nproc_per_node=")), 1)


def test_dry_run_of_repeats_matched_init_and_strong_scaling_runs_the_sides_alternately_at_one_global_batch():
    proc = launch(["--dry-run", "--nproc", "4", "--size", "1b", "--repeats", "3", "--matched-init", "--strong-scaling",
                   "--global-batch", "8", "--theirs", "compiled", "--ours", "full_compiled"], script=SCRIPT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^1b (torchtitan \w+|this repo \w+)(?: \(repeat (\d) of 3\))?: (.*)$", proc.stdout, flags=re.M)
    # Per GPU count: theirs, ours, theirs, ours, theirs, ours.
    assert [(run.split()[0], int(repeat)) for run, repeat, _ in lines] == \
        [(side, r) for _ in range(3) for r in (1, 2, 3) for side in ("torchtitan", "this")], proc.stdout[-3000:]
    seen = []
    for run, _, line in lines:
        argv = shlex.split(line)
        if run.startswith("torchtitan"):
            o = options(argv)
            assert o["--init"] == "normal"  # redrawn as transformers' Llama draws this repo's side
            seen.append((gpus(argv), int(o["--local-batch"])))
        else:
            ours = overrides(argv)
            assert "initializer_range:0.02" in ours["+recipe.model.config"]
            seen.append((gpus(argv), int(ours["recipe.data.batch_size"])))
    assert sorted(set(seen)) == [(1, 8), (2, 4), (4, 2)]  # 8 sequences a step on 1, 2 and 4 GPUs, both sides
    assert "| initial weights | init_weights, then every Linear and embedding weight redrawn from N(0, 0.02)" \
        in proc.stdout
    plain = launch(["--dry-run", "--nproc", "2", "--size", "1b"], script=SCRIPT, timeout=60)
    assert "--init" not in plain.stdout and "(repeat" not in plain.stdout
    assert "| initial weights (not matched) |" in plain.stdout


@pytest.mark.fast
def test_root_sets_this_repos_fsdp_root_alone_and_names_its_rows(capsys, tmp_path):
    assert bench.main(["--dry-run", "--nproc", "2", "--size", "1b", "--root", "split"]) == 0
    text = capsys.readouterr().out
    lines = re.findall(r"^1b (torchtitan \w+|this repo \w+): (.*)$", text, flags=re.M)
    for run, line in lines:
        argv = shlex.split(line)
        assert ("train.fsdp.root=split" in argv) == run.startswith("this repo")
    assert "train.fsdp.root=split, train.fsdp.init=meta" in text
    p = dataclasses.replace(plan("1b"), root="gathered")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    row = bench.ours_row(p, "full", {"mode": "full", "status": "ok", "run_dir": str(run_dir), "results": {}}, None)
    assert row["run"] == "this repo full (root gathered)"  # beside the default's row, against the same torchtitan
    assert bench.matched_key(row) == bench.matched_key(bench.ours_row(plan("1b"), "full", {"mode": "full", "status": "ok"}, None))


# ---- the table -------------------------------------------------------------------------------------

def test_both_sides_rows_come_from_one_formula_and_the_table_says_so(tmp_path):
    p = plan("8b", nproc=2)
    # The wall windows hold more than 20 median steps (what runs between them): tokens/s come from the windows.
    theirs = {"step_ms_median": 1990.0, "step_ms_p90": 2050.0, "step_ms_mean": 2000.0, "steps_timed": 20,
              "wall_s": 40.96, "wall_steps": 20,
              "losses": [12.25] + [9.0] * 30 + [7.5], "peak_allocated_mib": 90_000.0, "peak_reserved_mib": 95_000.0}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 12.0 - s / 10})
                                                   + "\n" for s in range(1, 33)))
    ours = {"mode": "full", "status": "ok", "run_dir": str(run_dir), "results": {
        "perf/step_ms_median": 1600.0, "perf/step_ms_p90": 1610.0, "perf/step_ms_mean": 1638.4, "perf/steps_timed": 20,
        "perf/wall_s": 32.768, "perf/wall_steps": 20,
        "perf/peak_allocated_mib": 80_000.0, "perf/peak_reserved_mib": 81_000.0, "perf/tokens_per_s": 10000.0}}
    failed = {"mode": "full_compiled", "status": "failed (exit 1): torch.OutOfMemoryError: CUDA out of memory",
              "run_dir": None, "results": {}}
    rows = [bench.theirs_row(p, "eager", theirs, "ok", 989.0, "tt"), bench.ours_row(p, "full", ours, 989.0),
            bench.ours_row(p, "full_compiled", failed, 989.0)]
    flops = 57_914_449_920
    assert rows[0]["tokens_per_s_per_gpu"] == pytest.approx(8192 * 20 / 40.96) == 4000.0  # the wall window's
    assert rows[1]["tokens_per_s_per_gpu"] == pytest.approx(8192 * 20 / 32.768) == 5000.0  # (issue 67)
    for row in rows[:2]:  # one formula, both sides
        assert row["mfu_pct"] == pytest.approx(100 * row["tokens_per_s_per_gpu"] * flops / 989e12)
    assert (rows[0]["loss_first"], rows[0]["loss_last"]) == (12.25, 7.5)
    assert (rows[1]["loss_first"], rows[1]["loss_last"]) == pytest.approx((11.9, 8.8))  # steps 1 and 32
    assert rows[0]["losses"] == theirs["losses"] and rows[1]["losses"] == pytest.approx([12.0 - s / 10 for s in
                                                                                         range(1, 33)])  # every step's
    assert rows[2]["losses"] == [] and rows[2]["loss_first"] is None  # a failed run has none
    assert rows[1]["peak_reserved_mib"] == 81_000.0 and rows[2]["tokens_per_s_per_gpu"] is None
    # Each run against torchtitan's fastest at the same settings; a run at other settings has no yardstick.
    other = dict(rows[1], ac="none")
    rows = bench.with_ratios([*rows, other])
    assert rows[1]["vs_torchtitan_best"] == pytest.approx(5000 / 4000)
    assert rows[1]["reserved_vs_torchtitan_best"] == pytest.approx(81_000 / 95_000)
    assert rows[2]["vs_torchtitan_best"] is None and rows[3]["vs_torchtitan_best"] is None
    text = bench.report(rows, [p], "NVIDIA H200", ("H200 SXM bf16 dense", 989.0))
    table = [line for line in text.splitlines() if line.startswith("| 8b |")]
    assert table[0].startswith("| 8b | torchtitan eager | 8192 x 1 | full | — | after-forward | bf16 | 4,000 | 23.4% | 1,990.0 | 2,050.0 | 90,000 | 95,000 "
                               "| 1.000x | 1.00x | 12.250 | 7.500 | ok |")  # allocator —: torch's default
    assert table[1].startswith("| 8b | this repo full | 8192 x 1 | full | — | after-forward | bf16 | 5,000 | 29.3% | 1,600.0 | 1,610.0 | 80,000 | 81,000 "
                               "| 1.250x | 0.85x |")
    assert table[2] == ("| 8b | this repo full_compiled | 8192 x 1 | full | — | after-forward | bf16 | — | — | — | — | — | — | — | — | — | — | failed (exit 1): "
                        "torch.OutOfMemoryError: CUDA out of memory |")
    assert table[3].startswith("| 8b | this repo full | 8192 x 1 | none | — | after-forward | bf16 | 5,000 | 29.3% |") and "| — | — |" in table[3]
    # Another allocator is another setting: no yardstick but a torchtitan run with that allocator.
    expandable = bench.ours_row(dataclasses.replace(p, alloc_conf="expandable_segments:True"), "full", ours, 989.0)
    assert expandable["alloc_conf"] == "expandable_segments:True" and rows[0]["alloc_conf"] is None
    assert bench.with_ratios([rows[0], expandable])[1]["vs_torchtitan_best"] is None
    never = bench.ours_row(dataclasses.replace(p, reshard="never"), "full", ours, 989.0)  # and so is resharding
    assert never["reshard"] == "never" and bench.with_ratios([rows[0], never])[1]["vs_torchtitan_best"] is None
    assert bench.shown({k: v for k, v in rows[0].items() if k != "reshard"}, "reshard") == "after-forward"  # old rows
    assert "activation_checkpoint.mode = the AC column" in text  # two AC settings in one table
    assert text.count("- `8b`: 32 layers x 4096") == 1 and "; 12 untimed steps, then 20 timed." in text
    small = dict(rows[0], size="1b", seq_len=2048)
    text = bench.report([*rows, small], [p], "NVIDIA H200", ("H200 SXM bf16 dense", 989.0))
    assert "- `1b`: 16 layers x 2048" in text and "at 2048 tokens; 2048 x 1 tokens per GPU per step" in text
    assert "| shape | each size's, above |" in text  # not 8b's shape for the 1b rows
    assert "| tokens per GPU per step | the tokens column: sequence length x sequences per GPU |" in text
    assert "| CUDA allocator | PYTORCH_CUDA_ALLOC_CONF=(unset) | the same |" in text  # one allocator in the table
    mixed = bench.report([*rows, expandable], [p], "NVIDIA H200", None)
    assert "| CUDA allocator | the allocator column: PYTORCH_CUDA_ALLOC_CONF | the same |" in mixed
    assert "6 x (parameters - token embedding) + 12 x layers x width x sequence length" in text
    assert "8,030,261,248 parameters" in text

    # --append: an earlier call's rows stay where this call did not rerun them.
    kept = [dict(rows[0], run="torchtitan compiled"), dict(rows[1], status="old")]
    merged = bench.merged(rows[1:3], kept)
    assert [(r["run"], r["status"]) for r in merged] == [("torchtitan compiled", "ok"), ("this repo full", "ok"),
                                                          ("this repo full_compiled", rows[2]["status"])]
    # The table's order: size, then settings (the most tokens first), torchtitan's runs before this repo's.
    short = dict(rows[1], seq_len=2048)
    order = sorted([rows[1], short, rows[0], small, rows[3], rows[2]], key=bench.table_order)
    assert [(r["size"], r["seq_len"], r["ac"], r["run"]) for r in order] == [
        ("8b", 8192, "full", "torchtitan eager"), ("8b", 8192, "full", "this repo full"),
        ("8b", 8192, "full", "this repo full_compiled"), ("8b", 8192, "none", "this repo full"),
        ("8b", 2048, "full", "this repo full"), ("1b", 2048, "full", "torchtitan eager")]


@pytest.mark.fast
def test_profile_adds_a_profiled_run_of_each_side_with_the_same_settings(capsys):
    assert bench.main(["--dry-run", "--nproc", "2", "--size", "1b", "--profile", "5", "--theirs", "compiled",
                       "--ours", "full_compiled", "--reshard", "never", "--", "graph.capture_error_mode=thread_local"]) == 0
    out = capsys.readouterr().out
    theirs = shlex.split(re.search(r"^1b torchtitan compiled: (.*)$", out, re.M).group(1))
    assert options(theirs)["--profile-steps"] == "5"  # after its 12 + 20 steps, in the same run
    timed = shlex.split(re.search(r"^1b this repo full_compiled: (.*)$", out, re.M).group(1))
    profiled = shlex.split(re.search(r"^1b this repo full_compiled, profiled: (.*)$", out, re.M).group(1))
    assert profiled[profiled.index("scripts/profile_step.py") + 1:][:2] == ["--steps", "5"] and "--memory" in profiled
    ours = dict(arg.split("=", 1) for arg in profiled if "=" in arg and not arg.startswith("-"))
    # profile_step.py's run takes 11 warm-up steps, the capture, 5 to settle, 5 timed and 5 profiled: 27 steps (of
    # 2 x 1 windows each); its data and max_steps grow, every other setting is the timed run's.
    assert (ours["train.max_steps"], ours["recipe.data.train_size"]) == ("27", str(2 * 27))
    same = {k: v for k, v in overrides(timed).items() if not k.startswith(("output_root", "logger.wandb"))}
    assert {k: ours.get(k) for k in same if k not in ("train.max_steps", "recipe.data.train_size")} == \
        {k: v for k, v in same.items() if k not in ("train.max_steps", "recipe.data.train_size")}
    assert ours["train.fsdp.reshard_after_forward"] == "false" and options(theirs)["--reshard"] == "never"
    assert ours["graph.capture_error_mode"] == "thread_local"  # the user's override, as in the timed run
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (what torchtitan's run_train.sh sets)" in out


def test_where_a_step_goes_is_one_table_per_matched_runs_by_kernel_kind():
    p = plan("1b", nproc=2, ac="none")

    def profiled(run, step_ms, kinds, busy, idle):
        return dict(bench.make_row(p, run, "ok", {"step_ms_mean": step_ms}, (None, None), [], 989.0, None,
                                   {"steps": 5, "gpu_busy_ms": busy, "idle_ms": idle, "gpu_ops_per_step": 900.0,
                                    "collective_beside_compute_ms": 20.0,
                                    "kinds": [{"kind": k, "ms_per_step": v, "per_step": 1.0} for k, v in kinds]}))

    rows = [profiled("torchtitan compiled", 180.0, [("matmuls", 100.0), ("attention", 40.0)], 178.0, 2.0),
            profiled("this repo full_compiled", 170.0, [("matmuls", 99.0), ("fused kernels (Triton)", 20.0)], 169.5,
                     0.5),
            bench.make_row(p, "this repo full", "ok", {"step_ms_mean": 200.0}, (None, None), [], 989.0,
                           None)]  # not profiled: not in the table
    rows[1]["profile"]["memory_pools"] = [{"graph": False, "reserved_mib": 9000.0, "peak_live_mib": 9000.0},
                                          {"graph": True, "reserved_mib": 19140.0, "peak_live_mib": 13000.0}]
    lines = bench.profile_report(rows)
    assert lines[1].startswith("Where a step goes, 1b, AC none, 2 GPUs, 8192 x 1 tokens per GPU: ms per step on "
                               "rank 0's GPU over 5/5 profiled steps")
    table = lines[3].splitlines()
    assert table[0] == "| ms per step | torchtitan compiled | this repo full_compiled |"
    assert table[2:] == ["| step (timed, no profiler) | 180.00 | 170.00 |", "| GPU busy (a kernel running) | 178.00 | 169.50 |",
                         "| GPU idle | 2.00 | 0.50 |", "| attention | 40.00 | 0.00 |", "| matmuls | 100.00 | 99.00 |",
                         "| fused kernels (Triton) | 0.00 | 20.00 |", "| collectives beside compute | 20.00 | 20.00 |",
                         "| kernels per step | 900 | 900 |", "| graph pool MiB: reserved / most live at once | — | 19,140 / 13,000 |"]
    assert bench.profile_report(rows[2:]) == []  # nothing profiled, no section


@pytest.mark.fast
def test_a_failed_run_is_reported_by_its_first_error_not_torchruns_report():
    stderr = ("W1127 warnings.warn(UserWarning: a warning)\n[rank0]: Traceback (most recent call last):\n"
              "[rank0]:   File \"x.py\", line 1\n"
              "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
              "[rank1]: RuntimeError: NCCL communicator was aborted\n"
              "    raise ChildFailedError(\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "============\nRoot Cause (first observed failure):\n  exitcode  : 1\n  error_file: <N/A>\n=======\n")
    assert bench.failure_line(stderr) == "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert bench.failure_line("x\ntorchtitan_worker: rank 0 ran past 60 s: stopping\n[rank1]: RuntimeError: reset\n") \
        == "torchtitan_worker: rank 0 ran past 60 s: stopping"
    assert bench.failure_line("Error: train.epochs=0 must be at least 1\n") == "Error: train.epochs=0 must be at least 1"
    assert bench.failure_line("something\nlast words\n") == "last words" and bench.failure_line("") == "(no output)"
    long = "[rank0]: trainer.run.errors.ConfigError: graph.compile_model=true with " + "x" * 400
    assert bench.failure_line(long) == long[:299] + "…"  # the error's name stays; the end of its words goes


def test_the_worker_trains_on_the_windows_this_repos_side_draws():
    import torch
    from omegaconf import OmegaConf

    from conf.schema import compose
    from recipes.gpt import language_data
    from scripts.lib.torchtitan_worker import batches, parse

    p = bench.Plan(SHAPES["8b"], nproc=2, seq_len=16, local_batch=3, warmup_steps=12, steps=2, ac="full")
    cfg = compose(bench.ours_overrides(p))
    ours = language_data(cfg.recipe.data, cfg.seed, cfg.recipe.model.context,
                         OmegaConf.to_container(cfg.recipe.model.config)["vocab_size"]).train
    args = parse(["--size", "8b", "--seq-len", "16", "--local-batch", "3", "--warmup-steps", "12", "--steps", "2",
                  "--ac", "full", "--output", "unused.json"])
    ranks = [batches(args, rank, 2, 128256) for rank in range(2)]
    assert all(len(steps) == 14 and steps[0][0].shape == (3, 16) and steps[0][0].dtype == torch.int64 for steps in ranks)
    theirs = torch.cat([x for steps in ranks for x, _ in steps])
    labels = torch.cat([y for steps in ranks for _, y in steps])
    assert len(ours) == len(theirs) == 2 * 3 * 14  # every window once, on one side as on the other
    assert sorted(map(tuple, theirs.tolist())) == sorted(map(tuple, ours.x.long().tolist()))
    assert torch.equal(labels[:, :-1], theirs[:, 1:])  # next-token labels


def test_the_worker_is_a_module_of_scripts_lib_and_no_script_imports_another():
    source = (ROOT / "scripts" / "bench_torchtitan.py").read_text()
    assert not re.search(r"^\s*(from|import) scripts\.(?!lib\b)", source, flags=re.M)
    assert (ROOT / "scripts" / "lib" / "torchtitan_worker.py").is_file()
    requirements = (ROOT / "scripts" / "requirements-torchtitan.txt").read_text()
    assert re.search(r"^torchtitan==0\.2\.2$", requirements, flags=re.M)
    assert not (ROOT / "requirements-torchtitan.txt").exists()  # never needed to train: not at the root


@pytest.mark.fast
def test_repeats_give_medians_and_the_ratio_over_the_pairs_with_time_to_loss_and_a_loss_plot(tmp_path):
    """Two repeats of each side: each row the median of its runs, the ratio's range over the pairs (repeat i
    against torchtitan's repeat i), the time from launch until the 10-step mean loss reaches the higher of the
    final means, and the curves drawn into a PNG beside the table."""
    p = dataclasses.replace(plan("1b", nproc=2, ac="none", steps=8), matched_init=True)  # 12 + 8 = 20 steps
    rows = []
    for repeat, (theirs_ms, ours_ms) in enumerate([(100.0, 80.0), (110.0, 85.0)]):
        theirs = {"step_ms_median": theirs_ms, "step_ms_p90": theirs_ms, "step_ms_mean": theirs_ms, "steps_timed": 8,
                  "wall_s": 8 * theirs_ms / 1e3, "wall_steps": 8,
                  "losses": [10.0 - 0.4 * s for s in range(20)], "peak_reserved_mib": 1000.0 + repeat,
                  "step_ended_at": [1000.0 + 30 + s for s in range(20)]}  # launched at 1000: 30 s of start-up
        rows.append(bench.theirs_row(p, "compiled", theirs, "ok", 989.0, "tt", repeat=repeat, launched_at=1000.0))
        run_dir = tmp_path / f"ours{repeat}"
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "train/loss": 10.0 - 0.5 * (s - 1), "time": 2000.0 + 20 + s}) + "\n" for s in range(1, 21)))
        ours = {"mode": "full_compiled", "status": "ok", "run_dir": str(run_dir), "results": {
            "perf/step_ms_median": ours_ms, "perf/step_ms_p90": ours_ms, "perf/step_ms_mean": ours_ms,
            "perf/steps_timed": 8, "perf/wall_s": 8 * ours_ms / 1e3, "perf/wall_steps": 8,
            "perf/peak_reserved_mib": 900.0}}
        rows.append(bench.ours_row(p, "full_compiled", ours, 989.0, repeat=repeat, launched_at=2000.0))
    timed = bench.with_time_to_loss(rows)
    # Final 10-step means: theirs 10 - 0.4 * 14.5 = 4.2, ours 10 - 0.5 * 14.5 = 2.75: the target is 4.2.
    assert [r["loss_target"] for r in timed] == pytest.approx([4.2] * 4)
    assert timed[0]["time_to_loss_s"] == pytest.approx(30 + 19)  # theirs reaches it at its last step (step 20)
    # Ours: the mean of steps k-9..k is 10 - 0.5 * (k - 5.5) <= 4.2 from step k = 18, which ended 20 + 18 s in.
    assert timed[1]["time_to_loss_s"] == pytest.approx(38)
    table = bench.with_ratios(bench.combined(timed))
    theirs_row, ours_row = table
    theirs_tokens, ours_tokens = (8192 / 0.100 + 8192 / 0.110) / 2, (8192 / 0.080 + 8192 / 0.085) / 2  # medians
    assert theirs_row["tokens_per_s_per_gpu"] == pytest.approx(theirs_tokens)
    assert ours_row["tokens_per_s_per_gpu"] == pytest.approx(ours_tokens)
    assert ours_row["vs_torchtitan_best"] == pytest.approx(ours_tokens / theirs_tokens)
    assert ours_row["vs_range"] == pytest.approx([100 / 80, 110 / 85])  # repeat 1's pair, then repeat 2's
    assert ours_row["pairs"] == 2 and theirs_row["vs_range"] is None
    assert theirs_row["peak_reserved_mib"] == 1001.0  # the highest of the repeats
    assert [r["repeat"] for r in ours_row["repeats"]] == [0, 1]
    text = bench.report(table, [p], "NVIDIA H200", None)
    line = next(line for line in text.splitlines() if line.startswith("| 1b | this repo full_compiled"))
    assert "| 1.250-1.294x (2 pairs) |" in line and "| 38 |" in line, line
    assert "Repeats: each row is the median of its runs" in text and "Time to loss: from the launch" in text
    assert "| initial weights | init_weights, then every Linear and embedding weight redrawn" in text
    output = tmp_path / "torchtitan_2gpu.json"
    plots = bench.loss_plots(table, output)
    png = tmp_path / "torchtitan_2gpu_loss_1b_2gpu_8192x1_none_matched_init.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"`{png.name}`" in plots
    assert "blue: torchtitan compiled, orange: this repo full_compiled" in plots
    # One run alone has nothing to reach: no time to loss, and no ratio range without repeats.
    alone = bench.with_time_to_loss(rows[:1])
    assert alone[0]["time_to_loss_s"] is None
    single = bench.with_ratios(bench.combined(bench.with_time_to_loss(rows[:2])))
    assert single[1]["vs_range"] is None and "over the pairs" not in bench.report(single, [p], "GPU", None)


@pytest.mark.fast
def test_strong_scaling_efficiency_is_tokens_per_gpu_over_one_gpus_at_the_same_global_batch():
    rows = []
    for nproc, ms in ((1, 400.0), (2, 220.0), (4, 125.0)):  # 8 sequences a step over all GPUs
        p = dataclasses.replace(plan("1b", nproc=nproc, ac="none"), local_batch=8 // nproc)
        timed = {"step_ms_median": ms, "step_ms_p90": ms, "step_ms_mean": ms, "steps_timed": 20,
                 "wall_s": 20 * ms / 1e3, "wall_steps": 20}
        rows.append(bench.theirs_row(p, "compiled", timed, "ok", None, "tt"))
    rows.append(dict(rows[2], local_batch=1, tokens_per_s_per_gpu=1.0))  # another global batch: no series
    out = bench.with_scaling(rows)
    per_gpu = [8192 * 8 / n / (ms / 1e3) for n, ms in ((1, 400.0), (2, 220.0), (4, 125.0))]
    assert [r["scaling_efficiency"] for r in out[:3]] == pytest.approx([1.0, per_gpu[1] / per_gpu[0],
                                                                        per_gpu[2] / per_gpu[0]])
    assert out[3]["scaling_efficiency"] is None
    assert bench.scaling_counts(8, 4) == [1, 2, 4] and bench.scaling_counts(4, 8) == [1, 2, 4]
    assert bench.scaling_counts(6, 3) == [1, 2, 3]


def test_the_worker_offers_what_time_steps_asks_of_a_trainer():
    """scripts/lib/timing.py times the worker's Steps as it times a Trainer: every attribute it reads of the object
    it times is a method of Steps or set by its __init__. (A rename of the Trainer's step method once left the
    worker without it: every torchtitan run failed on the GPU machine after its warm-up steps.)"""
    import ast
    import inspect

    from scripts.lib import timing
    from scripts.lib.torchtitan_worker import Steps

    timed = inspect.signature(timing.time_steps).parameters
    trainer = next(iter(timed))
    asked = {node.attr for node in ast.walk(ast.parse(inspect.getsource(timing.time_steps)))
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == trainer}
    init = ast.parse(inspect.cleandoc("\n" + inspect.getsource(Steps.__init__)))
    fields = {target.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
              for elt in node.targets for target in (elt.elts if isinstance(elt, ast.Tuple) else [elt])
              if isinstance(target, ast.Attribute)}
    fields |= {node.target.attr for node in ast.walk(init)
               if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute)}
    assert "next_step" in asked and "device" in asked  # what it reads today: the check below is not vacuous
    missing = sorted(a for a in asked if not callable(getattr(Steps, a, None)) and a not in fields)
    assert not missing, f"time_steps reads {missing} of what it times; scripts/lib/torchtitan_worker.Steps has none"


@pytest.mark.fast
def test_calls_that_share_a_runs_folder_keep_each_others_runs(tmp_path, capsys):
    """Each setting that changes a run names its folder: a float8 call, a strong-scaling call and a --root call into
    one --runs write where the bf16 call's runs are not (a shared folder once lost a float8 run's logs)."""
    calls = [[], ["--float8"], ["--root", "split", "--theirs", "none"], ["--reshard", "never"], ["--ac", "full"],
             ["--alloc-conf", ""], ["--matched-init"], ["--strong-scaling"]]
    folders = []
    for extra in calls:
        assert bench.main(["--dry-run", "--nproc", "2", "--size", "1b", "--runs", str(tmp_path), *extra]) == 0
        out = capsys.readouterr().out
        folders.append({line.split("output_root=")[1].split("/runs/")[0].strip("'\"")
                        for line in out.splitlines() if "output_root=" in line})
    assert all(len(f) == 1 for f in folders[:-1]) and len(folders[-1]) == 2, folders  # strong scaling: 1 and 2 GPUs
    every = [folder for f in folders for folder in f]
    assert len(set(every)) == len(every), every
