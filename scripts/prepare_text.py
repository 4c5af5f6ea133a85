"""Tokenize text files into token files that recipe=gpt_tiny (or gpt2_small) trains from.

    python scripts/prepare_text.py book.txt notes/*.md --output data/books
    python train.py recipe=gpt_tiny recipe.data.source=tokens recipe.data.root=data/books

Writes DIR/train.bin and DIR/val.bin (flat arrays of token ids, readable with
``np.memmap``; uint8 for a vocabulary of at most 256, uint16 up to 65536, else uint32)
and DIR/meta.json last, so a directory without meta.json was not finished. The inputs
are tokenized in the order given and concatenated; the last ``--val-fraction`` of the
tokens is the validation split. recipes/tokens.py describes the header and reads it.

Tokenizers: ``bytes`` (the default: one token per byte, vocabulary 256), or the path of
a HuggingFace ``tokenizer.json`` (needs the ``tokenizers`` package; nothing is downloaded).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, List, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.lib.refuse import refuse  # noqa: E402

CHUNK_BYTES = 1 << 24  # text is read and tokenized this much at a time


def byte_tokenizer() -> Tuple[str, int, Callable[[Path], Iterator[np.ndarray]]]:
    def encode(path: Path) -> Iterator[np.ndarray]:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield np.frombuffer(chunk, dtype=np.uint8)

    return "bytes", 256, encode


def huggingface_tokenizer(file: Path) -> Tuple[str, int, Callable[[Path], Iterator[np.ndarray]]]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        refuse(f"--tokenizer {file}: reading a tokenizer.json needs the `tokenizers` package "
               "(pip install tokenizers), or use --tokenizer bytes")
    if not file.is_file():
        refuse(f"--tokenizer {file}: no such file; give the path of a HuggingFace tokenizer.json "
               "or --tokenizer bytes")
    tokenizer = Tokenizer.from_file(str(file))

    def encode(path: Path) -> Iterator[np.ndarray]:
        with open(path, encoding="utf-8") as f:
            while lines := f.readlines(CHUNK_BYTES):  # whole lines: no token is cut at a chunk's edge
                yield np.asarray(tokenizer.encode("".join(lines)).ids, dtype=np.int64)

    return str(file.resolve()), tokenizer.get_vocab_size(), encode


def prepare(inputs: List[Path], output: Path, tokenizer: str = "bytes", val_fraction: float = 0.1) -> dict:
    """Writes the token files for ``inputs`` into ``output``; returns the header it wrote."""
    from recipes.tokens import META, SPLIT_FILES, dtype_for_vocab  # here: the recipe loads torch, `--help` need not

    name, vocab_size, encode = (byte_tokenizer() if tokenizer == "bytes"
                                else huggingface_tokenizer(Path(tokenizer).expanduser()))
    dtype = dtype_for_vocab(vocab_size)
    output.mkdir(parents=True, exist_ok=True)
    (output / META).unlink(missing_ok=True)  # unfinished until the header is written again
    train_path, val_path = (output / f for f in SPLIT_FILES)
    everything = output / "tokens.partial"
    total = 0
    with open(everything, "wb") as f:  # all tokens in one file first: the split point is known at the end
        for path in inputs:
            for ids in encode(path):
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
    meta = {"tokenizer": name, "vocab_size": vocab_size, "dtype": dtype,
            "tokens": {train_path.name: n_train, val_path.name: n_val},
            "val_fraction": val_fraction, "sources": [str(p.resolve()) for p in inputs]}
    (output / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text files, in order")
    parser.add_argument("--output", type=Path, required=True, metavar="DIR",
                        help="directory for train.bin, val.bin and meta.json")
    parser.add_argument("--tokenizer", default="bytes",
                        help="bytes (default, vocabulary 256) or the path of a HuggingFace tokenizer.json")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="share of the tokens, from the end of the text, kept for validation (default 0.1)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.inputs if not p.is_file()]
    if missing:
        parser.error(f"not a file: {', '.join(missing)}")
    if not 0.0 < args.val_fraction < 1.0:
        parser.error(f"--val-fraction={args.val_fraction} must be between 0 and 1 (exclusive)")
    meta = prepare(args.inputs, args.output, args.tokenizer, args.val_fraction)
    counts = meta["tokens"]
    print(f"{args.output}: {counts['train.bin']:,} train and {counts['val.bin']:,} val tokens "
          f"({meta['dtype']}, vocabulary {meta['vocab_size']:,}, tokenizer {meta['tokenizer']}) "
          f"from {len(args.inputs)} file(s)")
    vocab = "" if meta["vocab_size"] <= 256 else f" recipe.model.vocab={-(-meta['vocab_size'] // 64) * 64}"
    print(f"train with: python train.py recipe=gpt_tiny recipe.data.source=tokens recipe.data.root={args.output}"
          f"{vocab}")


if __name__ == "__main__":
    main()
