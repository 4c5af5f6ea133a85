"""Documents and conversations in, packed fixed-shape rows out.

What a user does: ``python scripts/prepare_text.py FILES --input documents|jsonl|chat|pairs --output DIR``
(a tokenizer directory for conversations: made here, in memory, nothing downloaded), then the recipe reads
``recipes.tokens.document_splits(DIR, ...)``: rows of ``context`` tokens, whole documents packed with
positions restarting at each, no label crossing into the next document, boundaries as document ids and
``cu_seqlens``, the loss only on the assistant's turns.
"""
from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.availability import needs_extra
from helpers.launches import launch
from helpers.paths import ROOT

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Marks the last assistant turn otherwise than earlier ones: the first k messages render unlike the whole's start.
NOT_PREFIX_STABLE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                     "{% if loop.last %} the answer{% endif %}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REFUSING = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversations start with the user') }}"
            "{% endif %}" + CHATML)
WORDS = "hello world how are you i am fine thanks what is two plus three five the answer user assistant system".split()
SPECIALS = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONVERSATION = [{"role": "system", "content": "you are fine"},
                {"role": "user", "content": "what is two plus three"},
                {"role": "assistant", "content": "five"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "hello world"}]


def prepare(*args) -> None:
    from scripts.prepare_text import main

    main([str(a) for a in args])


def refused(capsys, *args) -> str:
    """What prepare_text prints when it refuses ``args``: one message, exit 2."""
    with pytest.raises(SystemExit) as stopped:
        prepare(*args)
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    return err


def tokenizer_directory(directory: Path, template: str = CHATML) -> Path:
    """A word-level tokenizer of WORDS with ChatML's tokens and ``template``, saved as save_pretrained does."""
    needs_extra("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[2:])
    fast.chat_template = template
    fast.save_pretrained(directory)
    return directory


def ids_of(text: str) -> list:
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    return [vocab[w] for w in text.split()]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def split_documents(root: Path, name: str = "train"):
    """(tokens, offsets, loss mask or None) of one split, read back from the files."""
    meta = json.loads((root / "meta.json").read_text())
    tokens = np.fromfile(root / f"{name}.bin", dtype=meta["dtype"])
    offsets = np.load(root / f"{name}.docs.npy")
    loss = root / f"{name}.loss.bin"
    return tokens, offsets, (np.fromfile(loss, dtype=np.uint8) if loss.exists() else None)


def lognormal_documents(n: int, seed: int = 0, longest: int = 4096):
    """Documents of lognormal lengths around 300 tokens (sigma 1), 2 to ``longest``; token i is id i."""
    from trainer.data.packing import Documents

    lengths = np.clip(np.round(np.random.default_rng(seed).lognormal(np.log(300), 1.0, n)), 2, longest)
    offsets = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])
    return Documents(np.arange(offsets[-1], dtype=np.int64), offsets)


# ---- preparing each kind of input ----------------------------------------------------------

@pytest.mark.fast
def test_text_files_become_documents_one_per_file_or_split_at_a_separator(tmp_path, capsys):
    from recipes.tokens import token_splits

    first, second = tmp_path / "a.txt", tmp_path / "b.md"
    first.write_text("one whole document\nof two lines\n")
    parts = ["first part ünïcødé", "second part", "third part", "fourth part"]
    second.write_text("\n\n\n".join(parts) + "\n\n\n")  # a trailing separator: no empty document
    prepare(first, second, "--input", "documents", "--output", tmp_path / "per_file")
    assert "1 train and 1 val documents" in capsys.readouterr().out  # a file each; the last for validation
    prepare(first, second, "--input", "documents", "--separator", r"\n\n\n", "--output", tmp_path / "split",
            "--val-fraction", "0.3")
    assert "4 train and 1 val documents" in capsys.readouterr().out  # 5 documents; 30% of them: 1 for validation

    out = tmp_path / "split"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "train.docs.npy", "val.bin",
                                                      "val.docs.npy"]  # no loss mask: every token carries loss
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["format"], meta["input"], meta["loss"], meta["loss_mask"]) == (2, "documents", "all", None)
    assert (meta["end_of_text"], meta["vocab_size"], meta["dtype"]) == (255, 256, "uint8")
    texts = [first.read_text(), *parts]
    documents = []
    for name in ("train", "val"):
        tokens, offsets, _ = split_documents(out, name)
        assert offsets[0] == 0 and offsets[-1] == len(tokens) == meta["tokens"][f"{name}.bin"]
        documents += [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    # Each document is its text's bytes then the end of text, 0xFF: never a byte of UTF-8.
    assert [d[-1] for d in documents] == [255] * 5
    assert [d[:-1].tobytes().decode() for d in documents] == texts
    assert meta["documents"] == {"train.bin": 4, "val.bin": 1}
    # Old readers still read the directory: one stream of windows (document ends included).
    train, _ = token_splits(out, context=8, vocab=256)
    assert train[0][0].tolist() == list(texts[0].encode()[:8])
    # Without a separator a file is one document.
    tokens, offsets, _ = split_documents(tmp_path / "per_file", "val")
    assert tokens.tobytes() == second.read_bytes() + b"\xff" and offsets.tolist() == [0, len(tokens)]


@pytest.mark.fast
def test_json_lines_take_the_named_text_field(tmp_path, capsys):
    records = [{"body": f"document number {i} " + "word " * i, "id": i} for i in range(10)]
    source = write_jsonl(tmp_path / "docs.jsonl", records)
    prepare(source, "--input", "jsonl", "--text-field", "body", "--output", tmp_path / "out")
    capsys.readouterr()
    tokens, offsets, loss = split_documents(tmp_path / "out")
    val_tokens, val_offsets, _ = split_documents(tmp_path / "out", "val")
    assert loss is None and len(offsets) - 1 == 9 and len(val_offsets) - 1 == 1  # 10%: one whole document
    got = [tokens[a:b - 1].tobytes().decode() for a, b in zip(offsets[:-1], offsets[1:])]
    assert got == [r["body"] for r in records[:9]]
    assert val_tokens[:-1].tobytes().decode() == records[9]["body"] and val_tokens[-1] == 255


@pytest.mark.fast
def test_prompt_completion_pairs_carry_loss_on_the_completion_only(tmp_path, capsys):
    pairs = [{"prompt": f"Q: {i} plus {i}? A:", "completion": f" {2 * i}"} for i in range(8)]
    prepare(write_jsonl(tmp_path / "pairs.jsonl", pairs), "--input", "pairs", "--output", tmp_path / "out")
    assert "loss on assistant tokens" in capsys.readouterr().out
    tokens, offsets, loss = split_documents(tmp_path / "out")
    for pair, a, b in zip(pairs, offsets[:-1], offsets[1:]):
        prompt, completion = pair["prompt"].encode(), pair["completion"].encode()
        assert tokens[a:b].tobytes() == prompt + completion + b"\xff"
        # The completion and the end of text after it are the targets; the prompt never is.
        assert loss[a:b].tolist() == [0] * len(prompt) + [1] * (len(completion) + 1)
    prepare(tmp_path / "pairs.jsonl", "--input", "pairs", "--loss", "all", "--output", tmp_path / "all")
    assert not (tmp_path / "all" / "train.loss.bin").exists()


@pytest.mark.fast
def test_a_split_where_no_token_carries_loss_is_refused_naming_the_directory(tmp_path):
    """Nothing to learn and nothing to average the loss over (the step's metrics would divide by zero)."""
    from recipes.tokens import document_splits
    from trainer.run.errors import ConfigError

    pairs = [{"prompt": f"Q: {i} plus {i}? A:", "completion": f" {2 * i}"} for i in range(8)]
    prepare(write_jsonl(tmp_path / "pairs.jsonl", pairs), "--input", "pairs", "--output", tmp_path / "out")
    mask = tmp_path / "out" / "train.loss.bin"
    mask.write_bytes(bytes(mask.stat().st_size))  # every label a prompt's
    with pytest.raises(ConfigError, match=r"its train split has no token that carries loss .* --loss all"):
        document_splits(tmp_path / "out", context=64, vocab=256)


@pytest.mark.fast
@pytest.mark.extras
def test_conversations_render_with_the_chat_template_and_carry_loss_on_assistant_turns_only(tmp_path, capsys):
    from recipes.tokens import document_splits
    from trainer.data.packing import IGNORE_INDEX

    tokenizer = tokenizer_directory(tmp_path / "tokenizer")
    chats = [CONVERSATION, CONVERSATION[1:3], CONVERSATION]
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m, "id": i} for i, m in enumerate(chats)])
    prepare(source, "--input", "chat", "--tokenizer", tokenizer, "--output", tmp_path / "out",
            "--val-fraction", "0.34")
    assert "2 train and 1 val documents" in capsys.readouterr().out
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["input"], meta["loss"], meta["end_of_text"]) == ("chat", "assistant", 1)

    tokens, offsets, loss = split_documents(tmp_path / "out")
    whole = tokens[offsets[0]:offsets[1]].tolist()
    s, e = 2, 3  # <|im_start|>, <|im_end|>
    assert whole == ([s, *ids_of("system you are fine"), e, s, *ids_of("user what is two plus three"), e,
                      s, *ids_of("assistant five"), e, s, *ids_of("user thanks"), e,
                      s, *ids_of("assistant hello world"), e, 1])  # ChatML, then the end of text
    # Targets: each assistant turn's content and its <|im_end|>, and the end of text after the last turn.
    targets = [t for t, carries in zip(whole, loss[offsets[0]:offsets[1]]) if carries]
    assert targets == [*ids_of("five"), e, *ids_of("hello world"), e, 1]
    assert loss[offsets[1]:offsets[2]].sum() == 3  # the second: one user turn, one assistant turn, the end

    # Packed, the labels that count are exactly the assistant's tokens: the prompt carries none.
    train, val = document_splits(tmp_path / "out", context=64, vocab=64)
    row = train[0]
    counted = row["y"][row["y"] != IGNORE_INDEX].tolist()
    assert sorted(counted) == sorted(targets + [*ids_of("five"), e, 1])
    assert train.loss_tokens.tolist() == [len(counted)] and train.real_tokens.tolist() == [offsets[2]]
    assert len(val[0]["cu_seqlens"]) == len(row["cu_seqlens"]) == train.max_documents + 2  # one shape for both

    prepare(source, "--input", "chat", "--tokenizer", tokenizer, "--loss", "all", "--output", tmp_path / "all")
    capsys.readouterr()
    assert json.loads((tmp_path / "all" / "meta.json").read_text())["loss_mask"] is None
    assert split_documents(tmp_path / "all")[0].tolist() == tokens.tolist()  # the same tokens, no mask


@pytest.mark.fast
@pytest.mark.extras
def test_a_chat_template_that_is_not_prefix_stable_is_refused_naming_the_line(tmp_path, capsys):
    tokenizer = tokenizer_directory(tmp_path / "tokenizer", NOT_PREFIX_STABLE)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 3)
    err = refused(capsys, source, "--input", "chat", "--tokenizer", tokenizer, "--output", tmp_path / "out")
    assert err.startswith(f"{source}:1: the chat template of {tokenizer} is not prefix-stable"), err
    assert "--loss all" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing half-written
    # Loss on every token needs no turns found: the same template is fine.
    prepare(source, "--input", "chat", "--tokenizer", tokenizer, "--loss", "all", "--output", tmp_path / "out")


@pytest.mark.fast
@pytest.mark.extras
def test_a_conversation_the_template_refuses_and_a_tokenizer_without_a_template_are_named(tmp_path, capsys):
    tokenizer = tokenizer_directory(tmp_path / "tokenizer", REFUSING)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION[2:]}])
    err = refused(capsys, source, "--input", "chat", "--tokenizer", tokenizer, "--output", tmp_path / "out")
    assert err.startswith(f"{source}:2: the chat template of {tokenizer} refuses this conversation"), err
    assert "conversations start with the user" in err
    plain = tokenizer_directory(tmp_path / "plain", template=None)
    err = refused(capsys, source, "--input", "chat", "--tokenizer", plain, "--output", tmp_path / "out")
    assert "has no chat template" in err and str(plain) in err
    err = refused(capsys, source, "--input", "chat", "--output", tmp_path / "out")  # bytes: no template at all
    assert "--input chat renders conversations with the model's chat template: set --tokenizer" in err
    assert not (tmp_path / "out").exists()


# ---- bad input: one message naming the file and line (or flag), exit 2, nothing half-written ----

def test_a_user_running_the_script_on_a_line_without_the_field_sees_it_named_and_the_directory_kept(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "fine"}, {"text": "fine too"}])
    out = tmp_path / "out"
    good = launch([str(source), "--input", "jsonl", "--output", str(out)],
                  script=str(ROOT / "scripts" / "prepare_text.py"), timeout=120)
    assert good.returncode == 0, good.output[-2000:]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with open(source, "a") as f:
        f.write(json.dumps({"content": "the field is missing"}) + "\n")
    done = launch([str(source), "--input", "jsonl", "--output", str(out)],
                  script=str(ROOT / "scripts" / "prepare_text.py"), timeout=120)
    assert done.returncode == 2, done.output[-2000:]
    assert done.stderr.strip() == (f"{source}:3: no field 'text' (the line has 'content'): name the field with "
                                   "--text-field FIELD"), done.stderr
    assert "Traceback" not in done.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier preparation, untouched


@pytest.mark.fast
@pytest.mark.parametrize("case,message", [
    ("not json", "{source}:2: not JSON"),
    ("not an object", "{source}:2: a JSON list, not an object"),
    ("field not text", "{source}:2: field 'text' is a JSON int, not text: --text-field names a field of text"),
    ("empty input", "{source}: no documents (the input is empty"),
    ("one document", "{source}: one document; the validation split is whole documents"),
    ("missing tokenizer", "--tokenizer {missing}: no such file"),
    ("0xFF in a text file", "{text}:2: byte 0xFF at offset 12: not UTF-8 text"),
    ("flag of another input", "--separator is for --input documents, not --input jsonl"),
])
def test_each_bad_input_is_named_once_with_exit_2_and_nothing_written(tmp_path, capsys, case, message):
    source, text, missing = tmp_path / "in.jsonl", tmp_path / "in.txt", tmp_path / "no_such_model"
    lines = {"not json": '{"text": "a"}\n{"text": \n', "not an object": '{"text": "a"}\n["text"]\n',
             "field not text": '{"text": "a"}\n{"text": 7}\n', "empty input": "\n\n",
             "one document": '{"text": "alone"}\n'}
    source.write_text(lines.get(case, '{"text": "a"}\n{"text": "b"}\n'))
    text.write_bytes(b"fine\nbroken \xff here\n")
    args = {"missing tokenizer": ["--tokenizer", missing], "0xFF in a text file": [],
            "flag of another input": ["--separator", "x"]}.get(case, [])
    inputs = [text, "--input", "documents"] if case == "0xFF in a text file" else [source, "--input", "jsonl"]
    err = refused(capsys, *inputs, *args, "--output", tmp_path / "out")
    assert message.format(source=source, text=text, missing=missing) in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.fast
@pytest.mark.extras
def test_token_ids_past_the_tokenizers_vocabulary_are_refused_naming_the_line(tmp_path, capsys):
    needs_extra("transformers")  # tokenizers comes with it
    from tokenizers import Tokenizer, models, pre_tokenizers

    # A vocabulary with a hole: 3 entries, the last id 300 (the files of a tokenizer that disagree).
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 300}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}, {"text": "hello world"}])
    args = [source, "--input", "jsonl", "--tokenizer", tmp_path / "tokenizer.json", "--output", tmp_path / "out"]
    err = refused(capsys, *args)
    assert "names no end-of-text token to put between documents: name one with --eos-token" in err
    err = refused(capsys, *args, "--eos-token", "hello")
    assert err.startswith(f"{source}:2: token id 300 is past the vocabulary of 3 tokens"), err
    assert not (tmp_path / "out").exists()


# ---- packing ------------------------------------------------------------------------------

@pytest.mark.fast
def test_packed_rows_hold_every_token_once_with_positions_labels_and_boundaries_per_document():
    from trainer.data.packing import (
        IGNORE_INDEX, PADDING_DOCUMENT, PackedDocuments, cu_seqlens_from_document_ids, flatten_cu_seqlens,
    )

    documents = lognormal_documents(400, seed=1, longest=700)  # some longer than the context: cut into pieces
    context = 256
    packed = PackedDocuments(documents, context, seed=3, buffer=64, x_dtype=np.int64)
    offsets = documents.offsets
    document_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))  # token id -> its document
    rows = [packed[i] for i in range(len(packed))]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    real = batch["document_ids"] >= 0
    # Every token exactly once per epoch; padding only at a row's end.
    assert torch.equal(batch["x"][real].sort().values, torch.arange(offsets[-1]))
    assert all(torch.equal(r, r.sort(descending=True).values) for r in real.int())
    for row in rows:
        x, y, pos, doc = row["x"].numpy(), row["y"].numpy(), row["position_ids"].numpy(), row["document_ids"].numpy()
        for d in np.unique(doc):
            at = np.flatnonzero(doc == d)
            assert (np.diff(at) == 1).all() and (pos[at] == np.arange(len(at))).all()  # contiguous, positions from 0
            if d == PADDING_DOCUMENT:
                assert (y[at] == IGNORE_INDEX).all()
                continue
            assert len(set(document_of[x[at]])) == 1 and (np.diff(x[at]) == 1).all()  # one piece of one document
            last = x[at[-1]]
            ends_document = last + 1 == offsets[document_of[last] + 1]
            # Each label is the token after it in its document; a document's last token has none.
            assert (y[at[:-1]] == x[at[:-1]] + 1).all()
            assert y[at[-1]] == (IGNORE_INDEX if ends_document else last + 1)
    assert packed.plan.split_documents == int((documents.lengths() > context).sum()) > 0
    assert f"{packed.plan.split_documents:,} documents longer than {context} tokens cut into" in packed.describe()

    # Boundaries two ways that agree: cu_seqlens per row, and rebuilt from the document ids (as on the device).
    cu = batch["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu.shape == (len(rows), packed.max_documents + 2)
    assert torch.equal(cu_seqlens_from_document_ids(batch["document_ids"], cu.shape[1]), cu)
    assert (cu[:, -1] == context).all()
    # The flattened batch: one vector, segment ends of every row in order, unused entries the total.
    flat = flatten_cu_seqlens(cu[:5], context)
    ids = (batch["document_ids"][:5] + 1000 * torch.arange(5)[:, None]).flatten()  # ids unique across rows
    ends = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist() + [5 * context]
    assert flat.tolist() == [0, *ends] + [5 * context] * (len(flat) - 1 - len(ends))
    # Counts per row, for the trainer's logs: real tokens and loss tokens, and the padding.
    assert packed.real_tokens.tolist() == real.sum(1).tolist()
    assert packed.loss_tokens.tolist() == (batch["y"] != IGNORE_INDEX).sum(1).tolist()
    assert packed.padding_fraction == pytest.approx(1 - real.sum().item() / real.numel())


@pytest.mark.fast
@pytest.mark.parametrize("context", [4096, 2048])
def test_best_fit_decreasing_pads_at_most_two_percent_of_realistic_lengths(context):
    from trainer.data.packing import PackedDocuments

    documents = lognormal_documents(20_000)
    packed = PackedDocuments(documents, context)
    sequential_rows, free = 0, 0  # sequential greedy, the rule not taken, for scale
    for length in documents.lengths():
        for piece in [context] * (length // context) + [length % context] * bool(length % context):
            if piece > free:
                sequential_rows, free = sequential_rows + 1, context
            free -= piece
    sequential = 1 - documents.lengths().sum() / (sequential_rows * context)
    print(f"context {context}: padding {100 * packed.padding_fraction:.3f}% (sequential greedy "
          f"{100 * sequential:.1f}%), {len(packed)} rows, at most {packed.max_documents} documents in a row")
    assert packed.padding_fraction <= 0.02 < sequential
    assert packed.real_tokens.sum() == documents.offsets[-1]


def conversation_like(documents, seed: int = 1):
    """The documents with a loss mask as conversations carry one: a prompt of 10-60% of each, then the reply (about
    65% of the tokens carry loss in all)."""
    from trainer.data.packing import Documents

    rng = np.random.default_rng(seed)
    targets = np.zeros(documents.offsets[-1], np.uint8)
    for a, b in zip(documents.offsets[:-1], documents.offsets[1:]):
        targets[a + int((b - a) * rng.uniform(0.1, 0.6)):b] = 1
    return Documents(documents.tokens, documents.offsets, targets)


@pytest.mark.fast
@pytest.mark.parametrize("context,bound", [(4096, 3072), (2048, 1536)])
def test_a_loss_bound_holds_in_every_row_at_little_padding_and_no_loss_token_lost(context, bound):
    """recipe.model.head_loss_tokens_per_row: no row carries more loss tokens than the bound (the head's slots),
    at 3/4 of the context the padding stays under 1% (the data's share of loss tokens: 65%), and every loss token
    of the documents is in some row: the pieces with more than the bound are cut, not dropped."""
    from trainer.data.packing import IGNORE_INDEX, PackedDocuments

    documents = conversation_like(lognormal_documents(20_000, longest=context))
    free = PackedDocuments(documents, context)
    packed = PackedDocuments(documents, context, max_loss=bound, loss_key="recipe.model.head_loss_tokens_per_row")
    print(f"context {context}, at most {bound} loss tokens a row: padding {100 * packed.padding_fraction:.3f}% "
          f"(no bound: {100 * free.padding_fraction:.3f}%), {packed.plan.cut_for_loss} cuts; most in a row "
          f"{packed.loss_tokens.max()} (no bound: {free.loss_tokens.max()})")
    assert free.loss_tokens.max() > bound  # not vacuous: without the bound some rows hold more
    assert packed.loss_tokens.max() <= bound and packed.padding_fraction < 0.01
    assert packed.loss_tokens.sum() == free.loss_tokens.sum() and packed.real_tokens.sum() == documents.offsets[-1]
    assert packed.plan.cut_for_loss > 0 and "cuts where a piece's loss tokens reached a row's" in packed.describe()
    for i in np.random.default_rng(0).choice(len(packed), 50, replace=False):  # the rows as the step reads them
        assert (packed[int(i)]["y"] != IGNORE_INDEX).sum() == packed.loss_tokens[i] <= bound
    assert packed.for_epoch(1).loss_tokens.max() <= bound  # every epoch's packing keeps it


@pytest.mark.fast
def test_a_piece_cut_at_the_loss_bound_keeps_every_label_and_restarts_positions():
    """One document of 12 tokens, tokens 2-11 targets: 10 loss labels (positions 1-10; the last token has none).
    At most 4 a row: cut into pieces carrying 4, 4 and 2, each positioned from 0, the label of each piece's last
    token still its document's next token."""
    from trainer.data.packing import IGNORE_INDEX, Documents, PackedDocuments

    targets = np.array([0, 0] + [1] * 10, np.uint8)
    packed = PackedDocuments(Documents(np.arange(12), np.array([0, 12]), targets), 16, max_loss=4, x_dtype=np.int64)
    rows = [packed[i] for i in range(len(packed))]
    labels = sorted(int(v) for row in rows for v in row["y"][row["y"] != IGNORE_INDEX])
    assert labels == list(range(2, 12))  # every target token is a label once
    assert sorted(packed.loss_tokens.tolist()) == [2, 4, 4] and packed.plan.cut_for_loss == 2
    starts = sorted(int(row["x"][j]) for row in rows for j in range(16)
                    if row["document_ids"][j] >= 0 and row["position_ids"][j] == 0)
    assert starts == [0, 5, 9]  # pieces [0, 5) (labels 2..5), [5, 9) (6..9), [9, 12) (10, 11)


@pytest.mark.fast
def test_a_piece_over_the_loss_bound_is_refused_when_splitting_is_off():
    from trainer.data.packing import PackedDocuments
    from trainer.run.errors import ConfigError

    documents = conversation_like(lognormal_documents(200, longest=512))
    with pytest.raises(ConfigError, match=r"documents: document \d+ carries \d+ loss tokens, more than a row may hold "
                                          r"with head_loss=100 \(\d+ pieces do\): set split=true to cut them where "
                                          r"their loss tokens reach it, or raise head_loss \(at most the context, 512\)"):
        PackedDocuments(documents, 512, max_loss=100, split_long=False, split_key="split", loss_key="head_loss")


@pytest.mark.fast
def test_loss_masks_count_the_same_packed_or_read_in_chunks(monkeypatch):
    import trainer.data.packing as packing

    documents = lognormal_documents(300, seed=2, longest=900)
    targets = (np.random.default_rng(0).random(documents.offsets[-1]) < 0.5).astype(np.uint8)
    masked = packing.Documents(documents.tokens, documents.offsets, targets)
    monkeypatch.setattr(packing, "PREFIX_CHUNK", 1000)  # the loss mask summed 1000 tokens at a time
    packed = packing.PackedDocuments(masked, 512, x_dtype=np.int64)
    for i in range(len(packed)):
        row = packed[i]
        counted = row["y"] != packing.IGNORE_INDEX
        # A label counts exactly where its target token is marked, and it is that token.
        assert (targets[row["y"][counted].numpy()] == 1).all()
        labelled = (row["document_ids"] >= 0).numpy() & (row["y"] != packing.IGNORE_INDEX).numpy()
        assert packed.loss_tokens[i] == counted.sum() == labelled.sum()
    assert packed.loss_tokens.sum() == sum(targets[a + 1:b].sum() for a, b in zip(documents.offsets[:-1],
                                                                               documents.offsets[1:]))


@pytest.mark.fast
def test_a_row_is_the_same_in_every_process_and_run_so_resuming_mid_epoch_is_exact():
    from trainer.data.packing import PackedDocuments

    documents = lognormal_documents(500, seed=4, longest=1500)
    first, again = PackedDocuments(documents, 1024, seed=7), PackedDocuments(documents, 1024, seed=7)
    clone = pickle.loads(pickle.dumps(first))  # what a DataLoader worker holds
    for i in (0, 17, len(first) - 1):
        for other in (again, clone):
            assert all(torch.equal(first[i][k], other[i][k]) for k in first[i])
    batches = list(torch.utils.data.DataLoader(first, batch_size=8, num_workers=0))
    assert torch.equal(torch.cat([b["x"] for b in batches]), torch.stack([first[i]["x"] for i in range(len(first))]))
    other_seed, next_epoch = PackedDocuments(documents, 1024, seed=8), first.for_epoch(1)
    assert not torch.equal(other_seed[0]["x"], first[0]["x"]) and not torch.equal(next_epoch[0]["x"], first[0]["x"])
    assert next_epoch.max_documents == first.max_documents  # another packing, the same shapes
    assert next_epoch.real_tokens.sum() == first.real_tokens.sum() == documents.offsets[-1]


@pytest.mark.fast
def test_a_document_longer_than_a_row_is_refused_when_splitting_is_off():
    from trainer.data.packing import PackedDocuments
    from trainer.run.errors import ConfigError

    documents = lognormal_documents(50, seed=5, longest=3000)
    with pytest.raises(ConfigError, match=r"document \d+ has [\d,]+ tokens, more than a row of "
                                          r"recipe\.model\.context=512 .*set recipe\.data\.split_long_documents=true"):
        PackedDocuments(documents, 512, split_long=False, split_key="recipe.data.split_long_documents",
                        context_key="recipe.model.context")
    assert len(PackedDocuments(documents, 4096, split_long=False)) > 0


@pytest.mark.fast
def test_a_stream_directory_or_disagreeing_offsets_are_refused_by_the_document_reader(tmp_path, capsys):
    from recipes.tokens import document_splits
    from trainer.run.errors import ConfigError

    text = tmp_path / "a.txt"
    text.write_text("some words\n" * 40)
    prepare(text, "--output", tmp_path / "stream")
    with pytest.raises(ConfigError, match="one token stream without document boundaries .* --input documents"):
        document_splits(tmp_path / "stream", context=64, vocab=256)
    prepare(text, text, text, "--input", "documents", "--output", tmp_path / "docs")
    capsys.readouterr()
    train, val = document_splits(tmp_path / "docs", context=128, vocab=256)
    assert train.real_tokens.sum() == 2 * (440 + 1) and val.real_tokens.sum() == 441
    np.save(tmp_path / "docs" / "val.docs.npy", np.array([0, 5], dtype=np.int64))
    with pytest.raises(ConfigError, match=r"val\.docs\.npy: document offsets must run from 0 to the token count 441"):
        document_splits(tmp_path / "docs", context=128, vocab=256)


@pytest.mark.fast
def test_prepare_text_help_names_every_input(capsys):
    with pytest.raises(SystemExit) as done:
        prepare("--help")
    out = capsys.readouterr().out
    assert done.value.code == 0
    for flag in ("--input", "--separator", "--text-field", "--messages-field", "--prompt-field", "--completion-field",
                 "--loss", "--eos-token"):
        assert flag in out


@pytest.mark.fast
def test_a_tokenizer_directory_without_transformers_is_refused_with_the_install_command(tmp_path, capsys,
                                                                                     monkeypatch):
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 2)
    (tmp_path / "tokenizer").mkdir()
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an install without the hf extra has
    err = refused(capsys, source, "--input", "chat", "--tokenizer", tmp_path / "tokenizer", "--output", tmp_path / "o")
    assert err.strip() == (f"--tokenizer {tmp_path / 'tokenizer'}: a tokenizer directory (and --input chat) needs "
                           "transformers: pip install -r requirements-hf.txt")
