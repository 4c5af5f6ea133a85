"""Tokenize text into token files that the language-model recipes train from.

    python scripts/prepare_text.py book.txt notes/*.md --output data/books
    python train.py recipe=gpt_tiny recipe.data.source=tokens recipe.data.root=data/books

Writes DIR/train.bin and DIR/val.bin (flat arrays of token ids, readable with
``np.memmap``; uint8 for a vocabulary of at most 256, uint16 up to 65536, else uint32)
and DIR/meta.json last, so a directory without meta.json was not finished.
recipes/tokens.py describes the header and reads it.

What the inputs are (``--input``):
- ``stream`` (the default): text files tokenized in the order given and concatenated into one
  stream; the last ``--val-fraction`` of the tokens is the validation split.
- ``documents``: text files, each one document, or split into documents at ``--separator``.
- ``jsonl``: JSON Lines, each line's ``--text-field`` (default ``text``) one document.
- ``chat``: JSON Lines conversations, each line's ``--messages-field`` (default ``messages``) a list
  of ``{"role": ..., "content": ...}`` rendered by the tokenizer directory's own chat template.
- ``pairs``: JSON Lines of ``--prompt-field`` and ``--completion-field`` (default ``prompt`` and
  ``completion``): the prompt's tokens, then the completion's.

Every input but ``stream`` writes documents: each ends with the end-of-text token, DIR/train.docs.npy
and DIR/val.docs.npy say where each starts, the validation split is the last ``--val-fraction`` of
the documents (at least one), and for ``chat`` and ``pairs`` DIR/train.loss.bin and DIR/val.loss.bin
mark the tokens that carry loss: the assistant's turns (the completion) by default, or every
token with ``--loss all``. The assistant's turns are found by rendering each conversation's growing
prefixes and comparing their tokens with the whole conversation's (most chat templates have no
``{% generation %}`` markers, so ``apply_chat_template``'s assistant mask would be all zeros); a
template that renders earlier turns differently once later ones follow is refused.

Tokenizers (``--tokenizer``; nothing is downloaded):
- ``bytes`` (the default): one token per byte, vocabulary 256. Its end-of-text token is 255: the
  byte 0xFF never occurs in UTF-8 text, so every id keeps its meaning, the vocabulary stays 256
  and the files uint8 (an id 256 would double them to uint16 and make models of vocabulary 256
  too small). A text file holding 0xFF is not UTF-8 and is refused in document inputs.
- the path of a HuggingFace ``tokenizer.json`` (the ``tokenizers`` package); its end-of-text token is
  ``--eos-token``, else the ``eos_token`` of a tokenizer_config.json beside it.
- a tokenizer directory (``save_pretrained``; the ``transformers`` package: pip install -r
  requirements-hf.txt): its ``eos_token`` and, for ``chat``, its chat template.

Bad input (a JSON line without the named field, a conversation the template refuses, a missing
tokenizer, a token id past the vocabulary, no documents at all) is refused with the file and line,
exit 2, and leaves the output directory as it was.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.lib.refuse import refuse  # noqa: E402

CHUNK_BYTES = 1 << 24  # text is read and tokenized this much at a time
BYTES_END_OF_TEXT = 0xFF  # never a byte of UTF-8 text (see the module docstring)
INPUTS = ("stream", "documents", "jsonl", "chat", "pairs")
LOSSES = ("assistant", "all")
HF_EXTRA = "pip install -r requirements-hf.txt"


# ---- tokenizers ---------------------------------------------------------------------------

@dataclass
class TextTokenizer:
    """One tokenizer, whichever kind: ``encode(text, special)`` gives a document's ids (``special``: with the
    tokenizer's own added tokens, e.g. a BOS), ``stream(path)`` a file's ids chunk by chunk (``--input stream``)."""
    name: str
    vocab_size: int
    eos_id: Optional[int]
    encode: Callable[[str, bool], np.ndarray]
    stream: Callable[[Path], Iterator[np.ndarray]]
    chat: object = None  # the transformers tokenizer of a directory: its chat template
    is_bytes: bool = False


def byte_tokenizer() -> TextTokenizer:
    def stream(path: Path) -> Iterator[np.ndarray]:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield np.frombuffer(chunk, dtype=np.uint8)

    def encode(text, special: bool) -> np.ndarray:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8)

    return TextTokenizer("bytes", 256, BYTES_END_OF_TEXT, encode, stream, is_bytes=True)


def huggingface_tokenizer(file: Path, eos_token: Optional[str]) -> TextTokenizer:
    if not file.is_file():  # said first: a path that is not there is the fix, whatever is installed
        refuse(f"--tokenizer {file}: no such file; give the path of a HuggingFace tokenizer.json, a tokenizer "
               "directory, or --tokenizer bytes")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        refuse(f"--tokenizer {file}: reading a tokenizer.json needs the `tokenizers` package "
               "(pip install tokenizers), or use --tokenizer bytes")
    tokenizer = Tokenizer.from_file(str(file))

    def stream(path: Path) -> Iterator[np.ndarray]:
        with open(path, encoding="utf-8") as f:
            while lines := f.readlines(CHUNK_BYTES):  # whole lines: no token is cut at a chunk's edge
                yield np.asarray(tokenizer.encode("".join(lines)).ids, dtype=np.int64)

    def encode(text: str, special: bool) -> np.ndarray:
        return np.asarray(tokenizer.encode(text, add_special_tokens=special).ids, dtype=np.int64)

    config = file.parent / "tokenizer_config.json"
    if eos_token is None and config.is_file():
        named = json.loads(config.read_text()).get("eos_token")
        eos_token = named.get("content") if isinstance(named, dict) else named
    eos_id = None
    if eos_token is not None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            refuse(f"--eos-token {eos_token!r} is not a token of {file}: name one of its tokens")
    return TextTokenizer(str(file.resolve()), tokenizer.get_vocab_size(), eos_id, encode, stream)


def tokenizer_directory(directory: Path, eos_token: Optional[str]) -> TextTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        refuse(f"--tokenizer {directory}: a tokenizer directory (and --input chat) needs transformers: {HF_EXTRA}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # a directory transformers cannot read: say which and why, once
        refuse(f"--tokenizer {directory}: not a tokenizer directory transformers can read "
               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); give the directory that "
               "save_pretrained wrote (tokenizer.json, tokenizer_config.json)")

    def stream(path: Path) -> Iterator[np.ndarray]:
        with open(path, encoding="utf-8") as f:
            while lines := f.readlines(CHUNK_BYTES):
                yield encode("".join(lines), True)

    def encode(text: str, special: bool) -> np.ndarray:
        return np.asarray(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"], dtype=np.int64)

    eos_id = tokenizer.eos_token_id
    if eos_token is not None:
        eos_id = tokenizer.convert_tokens_to_ids(eos_token)
        if eos_id is None or eos_id == tokenizer.unk_token_id:
            refuse(f"--eos-token {eos_token!r} is not a token of {directory}: name one of its tokens")
    return TextTokenizer(str(directory.resolve()), len(tokenizer), eos_id, encode, stream, chat=tokenizer)


def load_tokenizer(spec: str, eos_token: Optional[str]) -> TextTokenizer:
    if spec == "bytes":
        if eos_token is not None:
            refuse(f"--eos-token {eos_token!r}: --tokenizer bytes ends documents with byte {BYTES_END_OF_TEXT}; "
                   "leave --eos-token out")
        return byte_tokenizer()
    path = Path(spec).expanduser()
    return tokenizer_directory(path, eos_token) if path.is_dir() else huggingface_tokenizer(path, eos_token)


# ---- inputs as documents ------------------------------------------------------------------

@dataclass
class Document:
    where: str  # FILE:LINE, for messages
    ids: np.ndarray
    targets: Optional[np.ndarray] = None  # uint8 per id: 1 where the id carries loss; None: every id


def unescape(separator: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` as typed in a shell, as the characters they name."""
    return re.sub(r"\\([ntr\\])", lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m.group(1)], separator)


def line_of(data: bytes, at: int) -> int:
    return data.count(b"\n", 0, at) + 1


def text_documents(paths: List[Path], separator: Optional[str], tokenizer: TextTokenizer) -> Iterator[Document]:
    """Each file one document, or its parts between ``separator``s (empty parts skipped)."""
    for path in paths:
        data = path.read_bytes()
        if tokenizer.is_bytes and BYTES_END_OF_TEXT in data:
            at = data.index(BYTES_END_OF_TEXT)
            refuse(f"{path}:{line_of(data, at)}: byte 0xFF at offset {at}: not UTF-8 text, and "
                   f"--tokenizer bytes ends each document with byte {BYTES_END_OF_TEXT}; convert the file to UTF-8 "
                   "(iconv -f latin1 -t utf-8) or use --input stream")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            refuse(f"{path}:{line_of(data, e.start)}: not UTF-8 text ({e.reason} at byte {e.start}); "
                   "convert it to UTF-8 (iconv -f latin1 -t utf-8)")
        parts = text.split(separator) if separator else [text]
        line = 1
        for part in parts:
            where = f"{path}:{line}"
            line += part.count("\n") + (separator or "").count("\n")
            if part.strip():
                yield Document(where, tokenizer.encode(part, True))


def json_lines(path: Path) -> Iterator[Tuple[str, dict]]:
    """(FILE:LINE, the line's object) for each non-blank line."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    refuse(f"{where}: not JSON ({e.msg} at column {e.colno}); a JSON Lines file holds one JSON "
                           "object per line")
                if not isinstance(record, dict):
                    refuse(f"{where}: a JSON {type(record).__name__}, not an object with named fields")
                yield where, record
    except UnicodeDecodeError as e:
        refuse(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); JSON Lines files are UTF-8")


def field(record: dict, name: str, flag: str, where: str, kind=str, what: str = "text"):
    if name not in record:
        has = ", ".join(map(repr, record)) or "no fields"
        refuse(f"{where}: no field {name!r} (the line has {has}): name the field with {flag} FIELD")
    value = record[name]
    if not isinstance(value, kind):
        refuse(f"{where}: field {name!r} is a JSON {type(value).__name__}, not {what}: {flag} names a field of {what}")
    return value


def jsonl_documents(paths: List[Path], text_field: str, tokenizer: TextTokenizer) -> Iterator[Document]:
    for path in paths:
        for where, record in json_lines(path):
            text = field(record, text_field, "--text-field", where)
            if text.strip():
                yield Document(where, tokenizer.encode(text, True))


def pair_documents(paths: List[Path], prompt_field: str, completion_field: str, tokenizer: TextTokenizer,
                   loss: str) -> Iterator[Document]:
    """The prompt's tokens then the completion's (tokenized apart: the boundary is exact); with loss on the
    assistant, the completion's tokens (and the end-of-text after them) are the targets."""
    for path in paths:
        for where, record in json_lines(path):
            prompt = tokenizer.encode(field(record, prompt_field, "--prompt-field", where), True)
            completion = tokenizer.encode(field(record, completion_field, "--completion-field", where), False)
            targets = None
            if loss == "assistant":
                targets = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)])
            yield Document(where, np.concatenate([prompt, completion]).astype(np.int64), targets)


def chat_documents(paths: List[Path], messages_field: str, tokenizer: TextTokenizer, loss: str) -> Iterator[Document]:
    for path in paths:
        for where, record in json_lines(path):
            messages = field(record, messages_field, "--messages-field", where, list, "a list of messages")
            for k, message in enumerate(messages):
                if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
                    refuse(f"{where}: message {k} of {messages_field!r} is not an object with a \"role\" and a "
                           f"\"content\" (it is {json.dumps(message)[:80]})")
            if messages:
                yield conversation(messages, tokenizer, where, loss)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def conversation(messages: List[dict], tokenizer: TextTokenizer, where: str, loss: str) -> Document:
    """One conversation rendered by the chat template; with loss on the assistant, its assistant turns found by
    rendering growing prefixes (the template must be prefix-stable: each prefix's text begins the whole's)."""
    template_of = f"the chat template of {tokenizer.name}"

    def render(part: List[dict], generation_prompt: bool = False) -> str:
        try:
            return tokenizer.chat.apply_chat_template(part, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # the template's own raise_exception, or what it cannot render
            refuse(f"{where}: {template_of} refuses this conversation ({type(e).__name__}: {e})")

    def tokens(text: str) -> np.ndarray:  # the template writes the special tokens itself
        return tokenizer.encode(text, False)

    whole = render(messages)
    ids = tokens(whole)
    if loss == "all":
        return Document(where, ids)
    targets = np.zeros(len(ids), np.uint8)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:k], generation_prompt=True) if k else ""
        through = render(messages[:k + 1])
        for prefix, what in ((before, f"the first {k} messages with the generation prompt"),
                             (through, f"the first {k + 1} messages")):
            if not whole.startswith(prefix):
                at = common_prefix(np.frombuffer(prefix.encode("utf-32-le"), np.uint32),
                                   np.frombuffer(whole.encode("utf-32-le"), np.uint32))
                refuse(f"{where}: {template_of} is not prefix-stable: {what} render as text that does not begin the "
                       f"whole conversation's (from character {at}: {prefix[at:at + 40]!r} against "
                       f"{whole[at:at + 40]!r}), so the assistant's turns cannot be found; use --loss all, or a "
                       "template that renders earlier turns alike whatever follows them")
        start = common_prefix(tokens(before), ids)
        through_ids = ids if len(through) == len(whole) else tokens(through)
        end = common_prefix(through_ids, ids)
        if end < len(through_ids):  # a token merged across the turn's end: it holds some of the turn
            end += 1
        targets[start:end] = 1
    return Document(where, ids, targets)


# ---- writing ------------------------------------------------------------------------------

def remove_stale(output: Path, keep: List[str]) -> None:
    """Document files an earlier preparation left that this one does not write (they would disagree)."""
    from recipes.tokens import DOCUMENT_SUFFIX, LOSS_SUFFIX, SPLIT_FILES, companion

    for name in SPLIT_FILES:
        for suffix in (DOCUMENT_SUFFIX, LOSS_SUFFIX):
            if companion(name, suffix) not in keep:
                (output / companion(name, suffix)).unlink(missing_ok=True)


def prepare(inputs: List[Path], output: Path, tokenizer: str = "bytes", val_fraction: float = 0.1) -> dict:
    """Writes the token files for ``inputs`` (one stream) into ``output``; returns the header it wrote."""
    from recipes.tokens import META, SPLIT_FILES, dtype_for_vocab  # here: the recipe loads torch, `--help` need not

    text_tokenizer = load_tokenizer(tokenizer, None)
    dtype = dtype_for_vocab(text_tokenizer.vocab_size)
    output.mkdir(parents=True, exist_ok=True)
    (output / META).unlink(missing_ok=True)  # unfinished until the header is written again
    remove_stale(output, [])
    train_path, val_path = (output / f for f in SPLIT_FILES)
    everything = output / "tokens.partial"
    total = 0
    with open(everything, "wb") as f:  # all tokens in one file first: the split point is known at the end
        for path in inputs:
            for ids in text_tokenizer.stream(path):
                f.write(ids.astype(dtype, copy=False).tobytes())
                total += len(ids)
    n_val = int(total * val_fraction)
    n_train = total - n_val
    tokens = np.memmap(everything, dtype=dtype, mode="r", shape=(total,)) if total else np.zeros(0, dtype)
    with open(val_path, "wb") as f:
        f.write(np.asarray(tokens[n_train:]).tobytes())
    del tokens
    os.truncate(everything, n_train * np.dtype(dtype).itemsize)  # what is left is the training split
    os.replace(everything, train_path)
    meta = {"tokenizer": text_tokenizer.name, "vocab_size": text_tokenizer.vocab_size, "dtype": dtype,
            "tokens": {train_path.name: n_train, val_path.name: n_val},
            "val_fraction": val_fraction, "sources": [str(p.resolve()) for p in inputs]}
    (output / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


@dataclass
class DocumentOptions:
    """How ``prepare_documents`` reads its inputs (the flags of the same names)."""
    input: str = "documents"
    tokenizer: str = "bytes"
    separator: Optional[str] = None
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    loss: str = "assistant"
    eos_token: Optional[str] = None
    val_fraction: float = 0.1


def documents_of(inputs: List[Path], options: DocumentOptions, tokenizer: TextTokenizer) -> Iterator[Document]:
    kind = options.input
    if kind == "documents":
        return text_documents(inputs, options.separator, tokenizer)
    if kind == "jsonl":
        return jsonl_documents(inputs, options.text_field, tokenizer)
    if kind == "pairs":
        return pair_documents(inputs, options.prompt_field, options.completion_field, tokenizer, options.loss)
    return chat_documents(inputs, options.messages_field, tokenizer, options.loss)


def check_chat_tokenizer(tokenizer: TextTokenizer, spec: str) -> None:
    if tokenizer.chat is None:
        refuse(f"--input chat renders conversations with the model's chat template: set --tokenizer to its "
               f"tokenizer directory (what save_pretrained wrote), not {spec}")
    if not getattr(tokenizer.chat, "chat_template", None):
        refuse(f"--tokenizer {spec}: this tokenizer has no chat template (tokenizer_config.json's chat_template or "
               "chat_template.jinja): give the directory of a chat model's tokenizer, or use --input jsonl")


def prepare_documents(inputs: List[Path], output: Path, options: DocumentOptions) -> dict:
    """Writes ``inputs`` as documents into ``output`` (the module docstring); returns the header it wrote.
    Every document is read before ``output`` changes: a refusal leaves it as it was."""
    from recipes.tokens import (
        DOCUMENT_SUFFIX, FORMAT_VERSION, LOSS_SUFFIX, META, SPLIT_FILES, companion, dtype_for_vocab,
    )

    tokenizer = load_tokenizer(options.tokenizer, options.eos_token)
    if options.input == "chat":
        check_chat_tokenizer(tokenizer, options.tokenizer)
    if tokenizer.eos_id is None:
        refuse(f"--tokenizer {options.tokenizer} names no end-of-text token to put between documents: name one "
               "with --eos-token TOKEN (e.g. '<|endoftext|>')")
    with_loss = options.input in ("chat", "pairs") and options.loss == "assistant"
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    partial = {"tokens": output / "tokens.partial", "loss": output / "loss.partial"}
    finished = False
    try:
        offsets, skipped = array("q", [0]), 0
        with open(partial["tokens"], "wb") as token_file, open(partial["loss"], "wb") as loss_file:
            for document in documents_of(inputs, options, tokenizer):
                ids = document.ids
                if len(ids) == 0:
                    skipped += 1
                    continue
                if ids.max() >= tokenizer.vocab_size or ids.min() < 0:
                    refuse(f"{document.where}: token id {int(ids.max())} is past the vocabulary of "
                           f"{tokenizer.vocab_size:,} tokens of --tokenizer {options.tokenizer}: the tokenizer's files "
                           "disagree (added tokens beyond its vocabulary?); fix or re-save the tokenizer")
                targets = document.targets
                if ids[-1] != tokenizer.eos_id:  # the end-of-text continues the turn it ends
                    ids = np.append(ids, tokenizer.eos_id)
                    if targets is not None:
                        targets = np.append(targets, targets[-1])
                token_file.write(ids.astype(dtype).tobytes())
                if with_loss:
                    loss_file.write((targets if targets is not None else np.ones(len(ids), np.uint8)).tobytes())
                offsets.append(offsets[-1] + len(ids))
        n = len(offsets) - 1
        names = ", ".join(map(str, inputs))
        if n == 0:
            refuse(f"{names}: no documents (the input is empty{', or holds only blank ones' if skipped else ''}): "
                   f"check the files and --input {options.input}")
        if n < 2:
            refuse(f"{names}: one document; the validation split is whole documents, so at least two are needed "
                   "(more input, or --input documents --separator to split a file)")
        n_val = min(max(1, int(n * options.val_fraction)), n - 1)
        n_train = n - n_val
        offsets = np.frombuffer(offsets, dtype=np.int64)
        cut = int(offsets[n_train])
        total = int(offsets[-1])

        (output / META).unlink(missing_ok=True)  # from here on the directory changes: unfinished until the header
        written = [companion(name, suffix) for name in SPLIT_FILES
                   for suffix in (DOCUMENT_SUFFIX, *((LOSS_SUFFIX,) if with_loss else ()))]
        remove_stale(output, written)
        train_file, val_file = SPLIT_FILES
        for kind, item_dtype, suffix in (("tokens", dtype, None), ("loss", np.uint8, LOSS_SUFFIX)):
            if kind == "loss" and not with_loss:
                continue
            values = np.memmap(partial[kind], dtype=item_dtype, mode="r", shape=(total,))
            with open(output / (val_file if suffix is None else companion(val_file, suffix)), "wb") as f:
                f.write(np.asarray(values[cut:]).tobytes())
            del values
            os.truncate(partial[kind], cut * np.dtype(item_dtype).itemsize)  # what is left is the training split
            os.replace(partial[kind], output / (train_file if suffix is None else companion(train_file, suffix)))
        np.save(output / companion(train_file, DOCUMENT_SUFFIX), offsets[:n_train + 1])
        np.save(output / companion(val_file, DOCUMENT_SUFFIX), offsets[n_train:] - cut)
        meta = {"format": FORMAT_VERSION, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                "dtype": dtype, "tokens": {train_file: cut, val_file: total - cut},
                "documents": {train_file: n_train, val_file: n_val},
                "document_offsets": {name: companion(name, DOCUMENT_SUFFIX) for name in SPLIT_FILES},
                "loss_mask": {name: companion(name, LOSS_SUFFIX) for name in SPLIT_FILES} if with_loss else None,
                "input": options.input,
                "loss": options.loss if options.input in ("chat", "pairs") else "all",
                "end_of_text": int(tokenizer.eos_id), "skipped_empty_documents": skipped,
                "val_fraction": options.val_fraction, "sources": [str(p.resolve()) for p in inputs]}
        (output / META).write_text(json.dumps(meta, indent=2) + "\n")
        finished = True
        return meta
    finally:
        for path in partial.values():
            path.unlink(missing_ok=True)
        if not finished and created and not any(output.iterdir()):
            output.rmdir()


# ---- the command line ---------------------------------------------------------------------

# The flags that only some inputs read: given with another input, they are refused by name.
INPUT_FLAGS = {"separator": ("documents",), "text_field": ("jsonl",), "messages_field": ("chat",),
               "prompt_field": ("pairs",), "completion_field": ("pairs",), "loss": ("chat", "pairs"),
               "eos_token": ("documents", "jsonl", "chat", "pairs")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text or JSON Lines files, in order")
    parser.add_argument("--output", type=Path, required=True, metavar="DIR",
                        help="directory for train.bin, val.bin, meta.json (and the document files)")
    parser.add_argument("--input", choices=INPUTS, default="stream",
                        help="what the inputs are: stream (default: text files as one stream, as before), "
                             "documents (a text file each, or split at --separator), jsonl (--text-field), "
                             "chat (--messages-field), pairs (--prompt-field, --completion-field)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="bytes (default, vocabulary 256), the path of a HuggingFace tokenizer.json, or a "
                             "tokenizer directory (save_pretrained; needs transformers; --input chat needs one)")
    parser.add_argument("--separator", help="--input documents: split each file into documents at this text "
                                            "(\\n, \\t escapes allowed, e.g. '\\n\\n\\n')")
    parser.add_argument("--text-field", help="--input jsonl: the field holding each document's text (default text)")
    parser.add_argument("--messages-field", help="--input chat: the field holding each conversation's list of "
                                                 "{role, content} messages (default messages)")
    parser.add_argument("--prompt-field", help="--input pairs: the prompt's field (default prompt)")
    parser.add_argument("--completion-field", help="--input pairs: the completion's field (default completion)")
    parser.add_argument("--loss", choices=LOSSES,
                        help="--input chat and pairs: which tokens carry loss: assistant (default: the assistant's "
                             "turns, the completion) or all")
    parser.add_argument("--eos-token", help="the token that ends each document (default: the tokenizer's eos_token; "
                                            "bytes: 255)")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="share kept for validation, from the end (default 0.1): of the tokens for --input "
                             "stream, of the documents (whole, at least one) otherwise")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.inputs if not p.is_file()]
    if missing:
        parser.error(f"not a file: {', '.join(missing)}")
    if not 0.0 < args.val_fraction < 1.0:
        parser.error(f"--val-fraction={args.val_fraction} must be between 0 and 1 (exclusive)")
    for name, inputs in INPUT_FLAGS.items():
        if getattr(args, name) is not None and args.input not in inputs:
            parser.error(f"--{name.replace('_', '-')} is for --input {' or '.join(inputs)}, not --input {args.input}")
    if args.separator is not None and not unescape(args.separator):
        parser.error("--separator is empty: name the text between documents")
    if args.input == "stream":
        meta = prepare(args.inputs, args.output, args.tokenizer, args.val_fraction)
        counts = meta["tokens"]
        print(f"{args.output}: {counts['train.bin']:,} train and {counts['val.bin']:,} val tokens "
              f"({meta['dtype']}, vocabulary {meta['vocab_size']:,}, tokenizer {meta['tokenizer']}) "
              f"from {len(args.inputs)} file(s)")
    else:
        given = {name: getattr(args, name) for name in INPUT_FLAGS if getattr(args, name) is not None}
        if "separator" in given:
            given["separator"] = unescape(given["separator"])
        options = DocumentOptions(input=args.input, tokenizer=args.tokenizer, val_fraction=args.val_fraction, **given)
        meta = prepare_documents(args.inputs, args.output, options)
        counts, documents = meta["tokens"], meta["documents"]
        loss = f", loss on {meta['loss']} tokens" if args.input in ("chat", "pairs") else ""
        skipped = meta["skipped_empty_documents"]
        print(f"{args.output}: {documents['train.bin']:,} train and {documents['val.bin']:,} val documents, "
              f"{counts['train.bin']:,} train and {counts['val.bin']:,} val tokens ({meta['dtype']}, vocabulary "
              f"{meta['vocab_size']:,}, tokenizer {meta['tokenizer']}, end of text {meta['end_of_text']}{loss}) from "
              f"{len(args.inputs)} file(s){f'; {skipped:,} empty documents skipped' if skipped else ''}")
    vocab = "" if meta["vocab_size"] <= 256 else f" recipe.model.vocab={-(-meta['vocab_size'] // 64) * 64}"
    print(f"train with: python train.py recipe=gpt_tiny recipe.data.source=tokens recipe.data.root={args.output}"
          f"{vocab}")


if __name__ == "__main__":
    main()
