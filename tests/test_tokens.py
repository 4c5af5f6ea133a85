"""Token files and large vocabularies: prepare text, train gpt_tiny from it, configure GPT-2 small.

What a user does: ``python scripts/prepare_text.py FILES --output DIR``, then
``python train.py recipe=gpt_tiny recipe.data.source=tokens recipe.data.root=DIR``.
"""
from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

TINY = ["recipe.model.n_layer=1", "recipe.model.d_model=32", "recipe.model.n_head=2", "recipe.model.context=16",
        "logger=none", "train.progress=false"]


def prepare(*args: str):
    from scripts.prepare_text import main

    main([str(a) for a in args])


def language(n_bytes: int, seed: int = 0) -> bytes:
    """Learnable text with a few multi-byte characters, so that tokens are bytes, not characters."""
    from recipes.gpt import synthetic_text

    tail = " ünïcødé\n".encode()
    return synthetic_text(seed, n_bytes - len(tail)) + tail


@pytest.fixture
def token_dir(tmp_path) -> Path:
    """A prepared directory from 20 kB of text: 18,000 train and 2,000 val tokens."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(language(20_000))
    prepare(text, "--output", tmp_path / "tokens")
    return tmp_path / "tokens"


# ---- preparing token files -------------------------------------------------------------

@pytest.mark.fast
def test_prepare_text_writes_train_and_val_files_that_round_trip_to_the_text(tmp_path, capsys):
    first, second = tmp_path / "a.txt", tmp_path / "b.md"
    first.write_bytes(language(3000, seed=1))
    second.write_bytes(language(1000, seed=2))
    prepare(first, second, "--output", tmp_path / "out", "--val-fraction", "0.25")
    assert "3,000 train and 1,000 val tokens" in capsys.readouterr().out

    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta == {"tokenizer": "bytes", "vocab_size": 256, "dtype": "uint8",
                    "tokens": {"train.bin": 3000, "val.bin": 1000}, "val_fraction": 0.25,
                    "sources": [str(first.resolve()), str(second.resolve())]}
    train = np.memmap(out / "train.bin", dtype=np.uint8, mode="r")
    val = np.memmap(out / "val.bin", dtype=np.uint8, mode="r")
    # The inputs, in order, concatenated; validation is the end of the text.
    assert train.tobytes() + val.tobytes() == first.read_bytes() + second.read_bytes()
    assert val.tobytes() == second.read_bytes()


@pytest.mark.fast
def test_prepare_text_picks_the_smallest_dtype_and_refuses_what_it_cannot_read(tmp_path, capsys):
    from recipes.tokens import dtype_for_vocab

    assert [dtype_for_vocab(v) for v in (256, 257, 65536, 65537, 50304)] == \
        ["uint8", "uint16", "uint16", "uint32", "uint16"]
    text = tmp_path / "a.txt"
    text.write_bytes(b"hello world\n" * 10)
    with pytest.raises(SystemExit) as missing_input:
        prepare(tmp_path / "nothing.txt", "--output", tmp_path / "out")
    with pytest.raises(SystemExit) as bad_fraction:
        prepare(text, "--output", tmp_path / "out", "--val-fraction", "1.5")
    assert missing_input.value.code == bad_fraction.value.code == 2
    err = capsys.readouterr().err
    assert f"not a file: {tmp_path / 'nothing.txt'}" in err and "--val-fraction=1.5" in err
    # A tokenizer file must exist and its package be installed; nothing is downloaded. A refusal: exit 2, once.
    with pytest.raises(SystemExit) as no_tokenizer:
        prepare(text, "--output", tmp_path / "out", "--tokenizer", tmp_path / "tokenizer.json")
    err = capsys.readouterr().err
    assert no_tokenizer.value.code == 2 and len(err.splitlines()) == 1, err
    assert re.match(r"--tokenizer .*tokenizer\.json: .*(tokenizers|no such file)", err), err
    assert not (tmp_path / "out").exists()


# ---- reading them: the dataset ---------------------------------------------------------

def write_token_dir(root: Path, train: np.ndarray, val: np.ndarray, vocab_size: int, **header) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    train.tofile(root / "train.bin")
    val.tofile(root / "val.bin")
    meta = {"tokenizer": "test", "vocab_size": vocab_size, "dtype": train.dtype.name,
            "tokens": {"train.bin": len(train), "val.bin": len(val)}, **header}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


@pytest.mark.fast
def test_token_windows_map_an_index_to_its_window_lazily_and_to_split_agrees(tmp_path):
    from recipes.tokens import token_splits

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, 1000, dtype=np.uint16)
    root = write_token_dir(tmp_path / "wide", ids, rng.integers(0, 1000, 200, dtype=np.uint16), 1000)
    train, test = token_splits(root, context=16, vocab=1024)
    assert (len(train), len(test)) == ((1000 - 1) // 16, (200 - 1) // 16)

    x, y = train[5]
    assert x.dtype == torch.int32 and y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert x.tolist() == ids[80:96].tolist() and y.tolist() == ids[81:97].tolist()
    assert train[-1][1].tolist() == ids[61 * 16 + 1: 62 * 16 + 1].tolist()
    with pytest.raises(IndexError):
        train[len(train)]

    split = train.to_split()  # what the device loader holds: the same windows in item order
    assert split.x.dtype == torch.int32 and split.y.dtype == torch.int64
    assert torch.equal(split.x, torch.stack([train[i][0] for i in range(len(train))]))
    assert torch.equal(split.y, torch.stack([train[i][1] for i in range(len(train))]))

    # A DataLoader worker gets the dataset pickled: small, the file mapped again on its side.
    clone = pickle.loads(pickle.dumps(train))
    assert len(pickle.dumps(train)) < 1000 and clone._tokens is None
    assert torch.equal(clone[7][0], train[7][0])
    batches = list(torch.utils.data.DataLoader(train, batch_size=8, num_workers=2))
    assert torch.equal(torch.cat([x for x, _ in batches]), split.x)
    assert torch.equal(torch.cat([y for _, y in batches]), split.y)


# ---- bad token directories: one message, before training -------------------------------

def _break(token_dir: Path, how: str) -> Path:
    meta_path = token_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    if how == "no directory":
        return token_dir.parent / "not_prepared"
    if how.startswith("no "):
        (token_dir / how[3:]).unlink()
        return token_dir
    if how == "count disagrees":
        with open(token_dir / "train.bin", "ab") as f:
            f.write(b"more text appended after preparing")
    elif how == "unknown dtype":
        meta["dtype"] = "float16"
    elif how == "vocab too large":
        meta["vocab_size"] = 50257
    elif how == "val too short":
        (token_dir / "val.bin").write_bytes(b"x" * 16)  # context 16 needs 17 tokens
        meta["tokens"]["val.bin"] = 16
    elif how == "not a header":
        meta_path.write_text("train.bin, val.bin")
        return token_dir
    meta_path.write_text(json.dumps(meta))
    return token_dir


@pytest.mark.fast
@pytest.mark.parametrize("how,message", [
    ("no directory", "not_prepared' is not a directory of token files"),
    ("no meta.json", "tokens' has no meta.json"),
    ("no train.bin", "tokens' has no train.bin"),
    ("no val.bin", "tokens' has no val.bin"),
    ("count disagrees", "train.bin holds 18034 bytes (18034 tokens of uint8) but {meta} says 18000 tokens"),
    ("unknown dtype", "{meta} says dtype='float16', which is not one of uint8, uint16, uint32"),
    ("vocab too large", "{meta} says vocab_size=50257 but the model has recipe.model.vocab=256: "
                        "set recipe.model.vocab=50257 or more"),
    ("val too short", "val.bin has 16 tokens, too few for one window of recipe.model.context=16 + 1"),
    ("not a header", "{meta} is not a token-file header"),
])
def test_a_bad_token_directory_is_named_once_before_training(train_here, token_dir, how, message):
    root = _break(token_dir, how)
    message = message.format(meta=token_dir / "meta.json")
    done = train_here(["recipe=gpt_tiny", *TINY, "recipe.data.source=tokens", f"recipe.data.root={root}",
                       "recipe.data.loader=device"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count(message) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "prepare_text.py" in done.stderr or "recipe.model" in done.stderr  # says what to do about it
    assert not done.run_dirs or not (done.run_dir / "results.json").exists()


def test_train_py_prints_a_bad_token_directory_once_and_exits_2(token_dir, train_here):
    _break(token_dir, "vocab too large")
    done = train_here(["recipe=gpt_tiny", *TINY, "recipe.data.source=tokens", f"recipe.data.root={token_dir}",
                       "recipe.data.loader=host"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("says vocab_size=50257") == 1, done.stderr
    assert "Traceback" not in done.stderr


# ---- training from token files ---------------------------------------------------------

@pytest.mark.fast
def test_gpt_trains_from_token_files_alike_on_device_and_host_loaders(train_here, token_dir, out):
    args = ["recipe=gpt_tiny", *TINY, "recipe.data.source=tokens", f"recipe.data.root={token_dir}",
            "train.max_steps=20", "train.log_every=5", "train.precision=fp32", "recipe.data.batch_size=8",
            "recipe.data.eval_batch_size=32", "recipe.optim.lr=3e-3", "recipe.schedule.warmup_steps=2"]
    device = train_here([*args, "recipe.data.loader=device"], out / "device")  # all windows on the device
    host = train_here([*args, "recipe.data.loader=host"], out / "host")  # windows read from the memory map
    for done in (device, host):
        assert done.returncode == 0, done.stderr[-3000:]
        res = done.results()
        assert res["data_source"] == "tokens" and res["steps"] == 20
        assert res["final/eval_tokens"] == (2000 - 1) // 16 * 16  # every val window, once
        losses = [m["train/loss"] for m in done.metrics() if "train/loss" in m]
        assert losses[0] > losses[-1] and res["final/loss"] < math.log(256) - 1, losses  # it learns
    for key in ("final/loss", "final/eval_loss", "final/eval_accuracy"):
        assert host.results()[key] == pytest.approx(device.results()[key], rel=1e-5), key


# ---- vocabulary and GPT-2 small --------------------------------------------------------

@pytest.mark.fast
def test_gpt2_small_config_has_gpt2s_shape_and_124m_parameters():
    from conf.schema import compose
    from recipes.gpt import GPT, model_config

    cfg = compose(["recipe=gpt2_small"])
    r = cfg.recipe
    assert r.name == "gpt2_small" and r._target_ == "recipes.gpt.build"
    c = model_config(r.model)
    assert (c.n_layer, c.n_head, c.d_model, c.context, c.vocab, c.dropout, c.layer_norm_bias) == \
        (12, 12, 768, 1024, 50304, 0.0, False)
    assert (r.optim._target_, r.optim.lr, list(r.optim.betas), r.optim.weight_decay) == \
        ("torch.optim.AdamW", 6e-4, [0.9, 0.95], 0.1)
    assert r.schedule._target_ == "trainer.step.schedules.Cosine" and r.schedule.warmup_steps > 0
    assert (cfg.train.precision.value, cfg.train.grad_clip) == ("bf16", 1.0)
    assert (r.data.batch_size, r.data.eval_batch_size, r.data.loader.value) == (16, 16, "auto")
    assert r.data.train_size * c.context <= 10_000_000  # an epoch of synthetic tokens stays modest

    with torch.device("meta"):  # no memory, no init time: just the shapes
        model = GPT(c)
    assert model.head.weight is model.tok_emb.weight  # tied: counted once
    n = sum(p.numel() for p in model.parameters())
    d = 768
    # per block 12·d² of matrices and two scale-only LayerNorms (d each); the final LayerNorm's d
    assert n == 12 * (12 * d * d + 2 * d) + 50304 * d + 1024 * d + d == 124_373_760
    assert model.training_flops_per_token() == 6 * (n - 1024 * d) + 12 * 12 * d * 1024


@pytest.mark.fast
def test_synthetic_tokens_over_a_large_vocabulary_are_deterministic_and_structured():
    from recipes.gpt import synthetic_splits, synthetic_token_ids

    vocab = 50304
    ids = synthetic_token_ids(0, 200_000, vocab)
    assert np.array_equal(ids, synthetic_token_ids(0, 200_000, vocab))
    assert not np.array_equal(ids, synthetic_token_ids(1, 200_000, vocab))
    words = np.unique(ids)
    assert 0 <= words[0] < 2000 and vocab - 2000 < words[-1] < vocab and 1000 < len(words) <= 4097
    # A first-order Markov chain: each word has at most 6 successors, or ends the sentence.
    pairs = np.unique(ids[:-1] * vocab + ids[1:])
    assert np.bincount(pairs // vocab).max() <= 7

    train, test = synthetic_splits(0, 16, 50, 5, vocab=vocab)
    assert train.x.shape == train.y.shape == (50, 16) and test.x.shape == (5, 16)
    assert train.x.dtype == torch.int32 and train.y.dtype == torch.int64
    assert torch.equal(train.x[:, 1:].long(), train.y[:, :-1])
    assert synthetic_splits(0, 16, 50, 5)[0].x.dtype == torch.uint8  # the byte language for vocab 256


@pytest.mark.fast
def test_gpt2_small_vocabulary_trains_on_synthetic_tokens_at_a_tiny_width(train_here):
    done = train_here(["recipe=gpt2_small", *TINY, "recipe.data.train_size=64", "recipe.data.test_size=8",
                       "recipe.data.batch_size=4", "recipe.data.eval_batch_size=8", "recipe.data.loader=device",
                       "train.max_steps=6", "train.log_every=2", "train.precision=fp32",
                       "recipe.optim.lr=1e-2", "recipe.schedule.warmup_steps=1"])
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["recipe"] == "gpt2_small" and res["data_source"] == "synthetic" and res["steps"] == 6
    losses = [m["train/loss"] for m in done.metrics() if "train/loss" in m]
    assert abs(losses[0] - math.log(50304)) < 0.5, losses  # a 50304-way output, near uniform at the start
    assert losses[-1] < losses[0] - 0.5 and math.isfinite(res["final/eval_loss"]), losses


@pytest.mark.fast
def test_token_files_need_a_model_vocabulary_that_holds_them(tmp_path):
    from conf.schema import compose
    from recipes.gpt import build
    from trainer.run.errors import ConfigError
    from trainer.run.runtime import Runtime

    rng = np.random.default_rng(0)
    root = write_token_dir(tmp_path / "wide", rng.integers(0, 1000, 600, dtype=np.uint16),
                           rng.integers(0, 1000, 100, dtype=np.uint16), 1000)
    rt = Runtime(0, 0, 1, torch.device("cpu"), False, Path("."))
    args = ["recipe=gpt_tiny", *TINY[:4], "recipe.data.source=tokens", f"recipe.data.root={root}"]
    with pytest.raises(ConfigError, match=r"vocab_size=1000 .* set recipe\.model\.vocab=1000"):
        build(compose(args), rt)
    recipe = build(compose([*args, "recipe.model.vocab=1024"]), rt)
    assert recipe.data.source == "tokens" and len(recipe.data.train) == (600 - 1) // 16
    assert recipe.model.tok_emb.weight.shape == recipe.model.head.weight.shape == (1024, 32)
    # A text file is bytes: a model that cannot hold 256 ids is refused.
    text = tmp_path / "a.txt"
    text.write_bytes(b"some text to read " * 100)
    with pytest.raises(ConfigError, match=r"recipe\.model\.vocab=100: set recipe\.model\.vocab=256"):
        build(compose(["recipe=gpt_tiny", *TINY[:4], f"recipe.data.path={text}", "recipe.model.vocab=100"]), rt)
