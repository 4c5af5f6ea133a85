"""A user sets this repo against TRL's SFTTrainer on conversations (scripts/bench_trl.py): the conversations spread
as said, both sides see the same tokens and loss tokens, the dry run shows both commands, and TRL's side runs.

TRL is an optional extra of the benchmark alone (scripts/requirements-trl.txt): the tests that need it skip
without it, saying how to install it.
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from helpers.availability import needs_extra
from helpers.launches import launch
from helpers.paths import ROOT
from scripts.lib import chat_data

import scripts.bench_trl as bench  # noqa: E402  (a test may import a script; scripts do not)

HAVE_TRL = importlib.util.find_spec("trl") is not None
INSTALL_TRL = "needs the optional trl: pip install -r scripts/requirements-trl.txt"
CONTEXT = 256  # the CPU runs' rows: conversations capped there, so neither side cuts one


def needs_trl():
    return pytest.importorskip("trl", reason=INSTALL_TRL)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Conversations capped at CONTEXT, the tokenizer trained on them, the tiny model: what both sides read."""
    needs_extra("transformers")
    root = tmp_path_factory.mktemp("bench_trl")
    chats = chat_data.write_conversations(root / "chats.jsonl", 40, seed=3, longest=CONTEXT)
    return {"chats": chats, "tokenizer": chat_data.tokenizer_directory(root / "tokenizer", chats),
            "model": chat_data.model_directory(root / "model", "tiny"), "root": root}


# ---- the conversations ----------------------------------------------------------------------

@pytest.mark.fast
def test_conversation_lengths_are_seeded_and_spread_lognormally_around_300_tokens():
    lengths = chat_data.rendered_lengths(4000, seed=0)
    assert np.array_equal(lengths, chat_data.rendered_lengths(4000, seed=0))
    assert not np.array_equal(lengths, chat_data.rendered_lengths(4000, seed=1))
    assert 280 <= np.median(lengths) <= 320
    q25, q75 = np.percentile(lengths, [25, 75])
    assert 3.3 < q75 / q25 < 4.5  # sigma 1: the quartiles e^(+-0.674) around the median, 3.85x apart
    assert lengths.min() >= chat_data.SHORTEST and lengths.max() == 4096  # the long tail reaches the cap
    assert chat_data.rendered_lengths(4000, seed=0, longest=CONTEXT).max() == CONTEXT


@pytest.mark.fast
def test_each_conversation_is_a_system_turn_then_exchanges_of_its_drawn_length():
    lengths = chat_data.rendered_lengths(300, seed=5)
    for conversation, length in zip(chat_data.conversations(300, seed=5), lengths):
        roles = [m["role"] for m in conversation["messages"]]
        assert roles[0] == "system" and roles[1:] == ["user", "assistant"] * ((len(roles) - 1) // 2)
        assert 1 <= (len(roles) - 1) // 2 <= 4
        words = sum(len(m["content"].split()) for m in conversation["messages"])
        assert words + chat_data.TOKENS_PER_TURN * len(roles) == length  # a word a token, three per turn


@pytest.mark.extras
def test_trls_assistant_mask_is_the_loss_prepare_text_marks(tiny, tmp_path):
    """TRL's assistant_only_loss reads apply_chat_template's assistant mask (the template's generation markers);
    prepare_text.py finds the assistant's turns by rendering prefixes. Both mark each assistant turn's content and
    its <|im_end|>; with <|im_end|> as the tokenizer's eos, prepare_text.py appends nothing after a conversation."""
    from transformers import AutoTokenizer

    from scripts.prepare_text import main as prepare

    tokenizer = AutoTokenizer.from_pretrained(str(tiny["tokenizer"]))
    prepare([str(tiny["chats"]), "--input", "chat", "--tokenizer", str(tiny["tokenizer"]), "--output",
             str(tmp_path / "tokens"), "--val-fraction", "0.1"])
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["end_of_text"] == tokenizer.convert_tokens_to_ids(chat_data.END_OF_TURN)
    tokens = np.fromfile(tmp_path / "tokens" / "train.bin", dtype=meta["dtype"])
    loss = np.fromfile(tmp_path / "tokens" / "train.loss.bin", dtype=np.uint8)
    offsets = np.load(tmp_path / "tokens" / "train.docs.npy")
    records = [json.loads(line) for line in tiny["chats"].read_text().splitlines()]
    lengths = chat_data.rendered_lengths(40, seed=3, longest=CONTEXT)
    end = tokenizer.convert_tokens_to_ids(chat_data.END_OF_TURN)
    for k in range(len(offsets) - 1):
        rendered = tokenizer.apply_chat_template(records[k]["messages"], tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        ours = slice(offsets[k], offsets[k + 1])
        assert rendered["input_ids"] == tokens[ours].tolist() and len(rendered["input_ids"]) == lengths[k]
        assert rendered["assistant_masks"] == loss[ours].tolist()
        assistants = [m for m in records[k]["messages"] if m["role"] == "assistant"]
        assert sum(rendered["assistant_masks"]) == sum(len(m["content"].split()) + 1 for m in assistants)
        assert rendered["input_ids"][-1] == end and rendered["assistant_masks"][-1] == 1  # TRL trains the stop


# ---- the command line -------------------------------------------------------------------------

@pytest.mark.fast
def test_the_dry_run_prints_both_sides_commands_and_makes_nothing(tmp_path, capsys):
    assert bench.main(["--dry-run", "--sizes", "tiny", "--steps", "30", "--warmup-steps", "12",
                       "--our-batch", "8", "--trl-batch", "6", "--work", str(tmp_path / "work")]) == 0
    lines = capsys.readouterr().out.splitlines()
    trl = next(line for line in lines if line.startswith("[tiny] TRL: "))
    ours = next(line for line in lines if line.startswith("[tiny] this repo: "))
    for words in ("-m scripts.lib.trl_worker", "--batch 6", "--steps 30", "--warmup-steps 12", "--context 4096",
                  "--attention varlen", "model_tiny_seed0"):
        assert words in trl, words
    for words in ("train.py recipe=hf_causal_lm", "recipe.data.batch_size=8", "train.max_steps=30",
                  "graph.warmup_iters=11", "graph=full_compiled", "recipe.data.attention_kernel=varlen",
                  "recipe.model.context=4096", "model_tiny_seed0"):
        assert words in ours, words
    assert any(line.startswith("[tiny] prepare: ") and "--input chat" in line for line in lines)
    assert not (tmp_path / "work").exists()


@pytest.mark.fast
def test_several_head_chunks_run_this_repo_once_each_beside_one_trl_run(tmp_path, capsys):
    assert bench.main(["--dry-run", "--sizes", "tiny", "--head-chunk", "none", "4096", "2048", "4096",
                       "--work", str(tmp_path / "work")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("[tiny] TRL: ") for line in lines) == 1
    ours = [line for line in lines if line.startswith("[tiny] this repo: ")]
    assert len(ours) == 3  # the repeated 4096 runs once
    for line, chunk, run_dir in zip(ours, ("null", "4096", "2048"), ("ours", "ours_chunk4096", "ours_chunk2048")):
        assert f"recipe.model.head_chunk_tokens={chunk}" in line and f"/{run_dir}" in line, line
    assert bench.head_words([bench.Head()]) == "the whole step's logits"
    assert bench.head_words([bench.Head(2048)]) == "in chunks of 2048 tokens (recipe.model.head_chunk_tokens)"


@pytest.mark.fast
def test_head_loss_tokens_run_this_repo_once_per_chunk_and_bound(tmp_path, capsys):
    assert bench.main(["--dry-run", "--sizes", "tiny", "--head-chunk", "4096", "--head-loss-tokens", "none", "3072",
                       "--work", str(tmp_path / "work")]) == 0
    ours = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[tiny] this repo: ")]
    assert len(ours) == 2
    for line, bound, run_dir in zip(ours, ("null", "3072"), ("ours_chunk4096", "ours_chunk4096_loss3072")):
        assert "recipe.model.head_chunk_tokens=4096" in line and f"/{run_dir}" in line, line
        assert f"recipe.model.head_loss_tokens_per_row={bound}" in line, line
    assert "head at <= 3072 loss tokens a row" in bench.Head(4096, 3072).label
    assert "recipe.model.head_loss_tokens_per_row" in bench.head_words([bench.Head(4096), bench.Head(4096, 3072)])


BAD = [  # (arguments, words of the one line)
    (["--sizes", "7b"], "argument --sizes: invalid choice: '7b'"),
    (["--warmup-steps", "60"], "--warmup-steps 60: at least 2"),
    (["--our-batch", "0"], "argument --our-batch: '0' is not a positive integer"),
    (["--head-chunk", "4096", "whole"], "argument --head-chunk: 'whole' is not a positive integer"),
    (["--attention", "sdpa"], "argument --attention: invalid choice: 'sdpa'"),
    (["--", "recipe.optim.lr=0.1"], "'recipe.optim.lr=0.1' is set by this script"),
    (["--", "train.epochz=3"], "Key 'epochz' not in 'TrainLoopConfig'"),
]


@pytest.mark.fast
@pytest.mark.parametrize("args,words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_option_is_one_line_and_exit_2(args, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--dry-run", *args])
    out, err = capsys.readouterr()
    assert stopped.value.code == 2, err
    assert err.splitlines() == [err.strip()] and err.startswith("bench_trl.py: "), err
    assert words in err and "Traceback" not in err and not out


@pytest.mark.skipif(HAVE_TRL, reason="checks the refusal where trl is not installed")
def test_without_trl_it_says_how_to_install_it_before_making_anything(tmp_path):
    proc = launch(["--sizes", "tiny", "--work", str(tmp_path / "work")], script="scripts/bench_trl.py", timeout=60)
    assert proc.returncode == 2, proc.stderr  # a refusal (scripts/lib/refuse.py), not a crash (1)
    assert "pip install -r scripts/requirements-trl.txt" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "work").exists()


# ---- TRL's side ---------------------------------------------------------------------------------

@pytest.mark.extras
def test_trls_padding_free_batch_through_this_repos_attention_scores_each_conversation_alone(tiny):
    """The worker's model: this repo's document attention, its mask made from TRL's flattened batch once per forward:
    each packed sequence's logits are those of the sequence alone (transformers' own SDPA, nothing packed)."""
    needs_trl()
    import argparse

    import torch
    import transformers
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from scripts.lib.trl_worker import load_model

    model = load_model(argparse.Namespace(model=tiny["model"], attention="dense", context=CONTEXT)).eval()
    alone = transformers.AutoModelForCausalLM.from_pretrained(str(tiny["model"]), dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    sequences = [torch.randint(4, 2000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 13, 5)]
    batch = DataCollatorForLanguageModeling(pad_token_id=1, padding_free=True)([{"input_ids": s} for s in sequences])
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        start = 0
        for sequence in sequences:
            expected = alone(torch.tensor([sequence])).logits[0]
            assert torch.allclose(packed[start:start + len(sequence)], expected, atol=1e-5), len(sequence)
            start += len(sequence)


@pytest.mark.extras
def test_a_cpu_run_of_the_tiny_model_through_the_trl_worker_ends_with_a_json_line(tiny):
    needs_trl()
    output = tiny["root"] / "trl.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.lib.trl_worker", "--model", str(tiny["model"]),
                           "--tokenizer", str(tiny["tokenizer"]), "--data", str(tiny["chats"]), "--context",
                           str(CONTEXT), "--batch", "2", "--steps", "5", "--warmup-steps", "2", "--attention", "dense",
                           "--no-compile", "--output", str(output)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads(output.read_text())
    assert (result["side"], result["torch_compile"], result["steps_timed"], result["wall_steps"]) == ("trl", False, 3, 3)
    assert result["settings"]["packing"] and result["settings"]["padding_free"] and result["settings"]["assistant_only_loss"]
    assert result["padding_fraction"] == 0.0 and 0 < result["real_tokens_per_step"] <= 2 * CONTEXT
    assert 0 < result["loss_tokens_per_step"] < result["real_tokens_per_step"]  # the prompts carry none
    assert result["wall_real_tokens_per_s"] > 0 and len(result["losses"]) == 5
    assert all(abs(loss - math.log(chat_data.SIZES["tiny"].vocab_size)) < 1.0 for loss in result["losses"])
