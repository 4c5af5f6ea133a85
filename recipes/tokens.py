"""Token files: a directory of ``train.bin``, ``val.bin`` and ``meta.json``, read as windows.

``scripts/prepare_text.py`` writes them. Each ``.bin`` is a flat array of token ids (no
header, nanoGPT-style, readable by ``np.memmap``) of the dtype ``meta.json`` names: uint8
for a vocabulary of at most 256, uint16 up to 65536, uint32 beyond. ``meta.json``::

    {"tokenizer": "bytes", "vocab_size": 256, "dtype": "uint8",
     "tokens": {"train.bin": 91234, "val.bin": 10137},
     "val_fraction": 0.1, "sources": ["/abs/path/a.txt", ...]}

A sample is the window of ``context + 1`` tokens starting at ``i * context``: consecutive
windows share their boundary token, so every token is predicted exactly once per epoch.
Which windows a step sees, and in what order, is the loader's business (a seeded
permutation per epoch and rank); ``TokenWindows`` only maps an index to its window.

Directories of documents (format 2, the second half of this file) add where each document starts
and, for conversations, which tokens carry loss; ``document_splits`` reads them as packed rows.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from trainer.data.packing import DEFAULT_BUFFER, Documents, PackedDocuments, check_offsets
from trainer.run.errors import ConfigError
from trainer.recipe import Split

META = "meta.json"
SPLIT_FILES = ("train.bin", "val.bin")
DTYPES = ("uint8", "uint16", "uint32")


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    for name in DTYPES:
        if vocab_size <= np.iinfo(name).max + 1:
            return name
    raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit in uint32")


def input_dtype(file_dtype: str) -> np.dtype:
    """How ``x`` is held: bytes stay uint8 (8x less memory than int64); wider ids as int32,
    the smallest signed type torch indexes with. The recipe's preprocess makes them int64."""
    return np.dtype(np.uint8) if file_dtype == "uint8" else np.dtype(np.int32)


def windows(tokens: torch.Tensor, context: int) -> Split:
    """Consecutive windows of ``context + 1`` tokens (sharing their boundary token) as (x, y)."""
    n = (len(tokens) - 1) // context
    x = tokens[: n * context].view(n, context).clone()
    y = tokens[1: n * context + 1].view(n, context).long()
    return Split(x, y)


class TokenWindows(torch.utils.data.Dataset):
    """Map-style dataset over one token file: item ``i`` is ``(x, y)`` of the window at ``i * context``.

    ``x``: [context] of ``input_dtype`` (uint8 for bytes, else int32); ``y``: [context] int64,
    ``x`` shifted by one. The file is memory-mapped lazily, once per process, so the dataset
    pickles small into DataLoader workers and each worker maps the file itself.
    ``to_split()`` reads all windows into two tensors, in item order (the device loader's path).
    """

    def __init__(self, path, dtype: str, context: int):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        self.path, self.dtype, self.context = Path(path), dtype, int(context)
        self.n_tokens = self.path.stat().st_size // np.dtype(dtype).itemsize
        self.x_dtype = input_dtype(dtype)
        self._tokens = None  # np.memmap, opened on first use in each process

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._tokens

    def __getstate__(self) -> Dict:
        state = dict(self.__dict__)
        state["_tokens"] = None  # a memmap would pickle as a copy of the whole file
        return state

    def __len__(self) -> int:
        return max(self.n_tokens - 1, 0) // self.context

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} of {n}")
        start = (i % n) * self.context
        window = np.asarray(self.tokens[start: start + self.context + 1])
        return (torch.from_numpy(window[:-1].astype(self.x_dtype)),
                torch.from_numpy(window[1:].astype(np.int64)))

    def to_split(self) -> Split:
        tokens = np.asarray(self.tokens[: len(self) * self.context + 1]).astype(self.x_dtype)
        return windows(torch.from_numpy(tokens), self.context)


def read_header(root, context: int, vocab: int, data_key: str = "recipe.data.root",
                vocab_key: str = "recipe.model.vocab") -> Dict:
    """``root/meta.json``, checked against the files beside it and the model; ConfigError names what to fix
    (``vocab_key``: the setting that sizes the model's vocabulary).

    Reads only the header and the files' sizes, so every rank can check before any trains.
    """
    directory = Path(root).expanduser()
    prepare = f"run `python scripts/prepare_text.py TEXT_FILE... --output {root}`, or set {data_key}=<that directory>"
    if not directory.is_dir():
        raise ConfigError(f"{data_key}={str(root)!r} is not a directory of token files: {prepare}")
    for name in (META, *SPLIT_FILES):
        if not (directory / name).is_file():
            raise ConfigError(f"{data_key}={str(root)!r} has no {name}: {prepare}")
    meta_path = directory / META
    try:
        meta = json.loads(meta_path.read_text())
        dtype, vocab_size, counts = meta["dtype"], meta["vocab_size"], meta["tokens"]
        counts = {name: counts[name] for name in SPLIT_FILES}
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{meta_path} is not a token-file header (needs dtype, vocab_size and tokens for "
                          f"{' and '.join(SPLIT_FILES)}; {type(e).__name__}: {e}): {prepare}") from None
    if dtype not in DTYPES:
        raise ConfigError(f"{meta_path} says dtype={dtype!r}, which is not one of {', '.join(DTYPES)}: "
                          f"re-create the files ({prepare})")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError(f"{meta_path} says vocab_size={vocab_size!r}, not a positive integer: {prepare}")
    if vocab_size > vocab:
        raise ConfigError(f"{meta_path} says vocab_size={vocab_size} but the model has {vocab_key}={vocab}: "
                          f"set {vocab_key}={vocab_size} or more (a multiple of 64 runs faster)")
    itemsize = np.dtype(dtype).itemsize
    for name in SPLIT_FILES:
        size = (directory / name).stat().st_size
        if size % itemsize or size // itemsize != counts[name]:
            raise ConfigError(f"{directory / name} holds {size} bytes ({size / itemsize:g} tokens of {dtype}) but "
                              f"{meta_path} says {counts[name]} tokens: the files are truncated or from different "
                              f"runs; re-create them ({prepare})")
        if counts[name] < context + 1:
            raise ConfigError(f"{directory / name} has {counts[name]} tokens, too few for one window of "
                              f"recipe.model.context={context} + 1: use more text (or a larger "
                              f"--val-fraction for val.bin), or a smaller recipe.model.context")
    return meta


def token_splits(root, context: int, vocab: int, data_key: str = "recipe.data.root",
                 vocab_key: str = "recipe.model.vocab") -> Tuple[TokenWindows, TokenWindows]:
    """(train, test) windows of the token files in ``root``, after ``read_header``'s checks."""
    meta = read_header(root, context, vocab, data_key, vocab_key)
    directory = Path(root).expanduser()
    return tuple(TokenWindows(directory / name, meta["dtype"], context) for name in SPLIT_FILES)


# ---- documents: format 2 ------------------------------------------------------------------
#
# ``prepare_text.py --input documents|jsonl|chat|pairs`` writes, beside each split's .bin, where its
# documents start and, for conversations and prompt/completion pairs, which tokens carry loss:
#
#   train.docs.npy   int64 [documents + 1]: document d is train.bin[offsets[d]:offsets[d + 1]]
#   train.loss.bin   uint8 [tokens]: 1 where the token is a target that carries loss (absent: every token)
#
# and meta.json says so (older directories have no "format": one stream, format 1)::
#
#   {"format": 2, ..., "documents": {"train.bin": 1200, "val.bin": 134},
#    "document_offsets": {"train.bin": "train.docs.npy", "val.bin": "val.docs.npy"},
#    "loss_mask": {"train.bin": "train.loss.bin", "val.bin": "val.loss.bin"},   (or null)
#    "input": "chat", "loss": "assistant", "end_of_text": 2}
#
# Each document ends with the end-of-text token. ``document_splits`` packs them into rows
# (trainer/data/packing.py); ``token_splits`` still reads the same files as windows of one stream.

FORMAT_VERSION = 2
DOCUMENT_SUFFIX = ".docs.npy"
LOSS_SUFFIX = ".loss.bin"


def companion(split_file: str, suffix: str) -> str:
    """The file beside a split's tokens: ("train.bin", ".docs.npy") -> "train.docs.npy"."""
    return split_file[: -len(".bin")] + suffix


class DocumentFiles(Documents):
    """One split's documents from its files, memory-mapped lazily in each process (pickles small, like
    ``TokenWindows``)."""

    def __init__(self, directory, split_file: str, dtype: str, loss_file: Optional[str] = None):
        self.directory, self.split_file, self.dtype, self.loss_file = Path(directory), split_file, dtype, loss_file
        self.name = str(self.directory / split_file)
        self._maps: Optional[Dict] = None

    def _map(self) -> Dict:
        if self._maps is None:
            tokens = np.memmap(self.directory / self.split_file, dtype=self.dtype, mode="r")
            offsets = np.load(self.directory / companion(self.split_file, DOCUMENT_SUFFIX), mmap_mode="r")
            self._maps = {"tokens": tokens, "offsets": offsets,
                          "targets": (np.memmap(self.directory / self.loss_file, dtype=np.uint8, mode="r")
                                      if self.loss_file else None)}
        return self._maps

    @property
    def tokens(self) -> np.ndarray:
        return self._map()["tokens"]

    @property
    def offsets(self) -> np.ndarray:
        return self._map()["offsets"]

    @property
    def targets(self) -> Optional[np.ndarray]:
        return self._map()["targets"]

    def __getstate__(self) -> Dict:
        state = dict(self.__dict__)
        state["_maps"] = None  # a memmap would pickle as a copy of the whole file
        return state


def has_documents(root) -> bool:
    """Whether ``root``'s header says it holds documents (format 2), read without checks (``read_header`` and
    ``read_document_header`` check it when the splits are read)."""
    try:
        meta = json.loads((Path(root).expanduser() / META).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get("format"), int) and meta["format"] >= 2


def read_document_header(root, vocab: int, data_key: str = "recipe.data.root",
                         vocab_key: str = "recipe.model.vocab") -> Dict:
    """``read_header``'s checks, and the document files' (offsets and loss masks agree with the tokens):
    ConfigError names what to fix. A directory of one stream (format 1) is refused, saying how to re-create it."""
    meta = read_header(root, 0, vocab, data_key, vocab_key)  # context 0: a split needs a token, not a window
    directory = Path(root).expanduser()
    meta_path = directory / META
    redo = (f"re-create it with `python scripts/prepare_text.py INPUT... --input documents --output {root}` "
            "(or --input jsonl, chat, pairs)")
    version = meta.get("format", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError(f"{meta_path} says format={version!r}; this version reads up to {FORMAT_VERSION}: "
                          f"update the repository, or {redo}")
    if version < 2 or not isinstance(meta.get("documents"), dict):
        raise ConfigError(f"{meta_path} describes one token stream without document boundaries (format {version}): "
                          f"{redo}")
    loss_files = meta.get("loss_mask") or {}
    for name in SPLIT_FILES:
        try:
            offsets = np.load(directory / companion(name, DOCUMENT_SUFFIX), mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{directory / companion(name, DOCUMENT_SUFFIX)} cannot be read "
                              f"({type(e).__name__}: {e}): {redo}") from None
        if offsets.dtype != np.int64 or len(offsets) != meta["documents"].get(name, -1) + 1:
            raise ConfigError(f"{directory / companion(name, DOCUMENT_SUFFIX)} holds {len(offsets)} {offsets.dtype} "
                              f"offsets but {meta_path} says {meta['documents'].get(name)} documents: {redo}")
        try:
            check_offsets(np.asarray(offsets), meta["tokens"][name], str(directory / companion(name, DOCUMENT_SUFFIX)))
        except ValueError as e:
            raise ConfigError(f"{e}: {redo}") from None
        if name in loss_files:
            path = directory / loss_files[name]
            if not path.is_file() or path.stat().st_size != meta["tokens"][name]:
                size = path.stat().st_size if path.is_file() else "no"
                raise ConfigError(f"{path} holds {size} bytes but {meta_path} says {meta['tokens'][name]} tokens, "
                                  f"one loss-mask byte each: {redo}")
    return meta


def document_splits(root, context: int, vocab: int, *, seed: int = 0, buffer: int = DEFAULT_BUFFER,
                    split_long: bool = True, max_documents: Optional[int] = None, max_loss: Optional[int] = None,
                    data_key: str = "recipe.data.root", vocab_key: str = "recipe.model.vocab",
                    split_key: str = "split_long_documents", context_key: str = "recipe.model.context",
                    loss_key: str = "max_loss_tokens") -> Tuple[PackedDocuments, PackedDocuments]:
    """(train, test) packed rows of the documents in ``root`` (trainer/data/packing.py), after
    ``read_document_header``'s checks. The test split takes the training split's ``max_documents``, so both
    carry ``cu_seqlens`` of one length; ``max_loss`` (the most loss tokens a row carries) binds both."""
    meta = read_document_header(root, vocab, data_key, vocab_key)
    directory = Path(root).expanduser()
    loss_files = meta.get("loss_mask") or {}
    splits = []
    for name in SPLIT_FILES:
        documents = DocumentFiles(directory, name, meta["dtype"], loss_files.get(name))
        splits.append(PackedDocuments(documents, context, seed=seed, buffer=buffer, split_long=split_long,
                                      max_documents=max_documents, max_loss=max_loss,
                                      x_dtype=input_dtype(meta["dtype"]), split_key=split_key,
                                      context_key=context_key, loss_key=loss_key))
        max_documents = splits[0].max_documents
        if int(splits[-1].loss_tokens.sum()) == 0:  # every label a prompt's: nothing to learn or to average over
            raise ConfigError(f"{data_key}={root}: its {Path(name).stem} split has no token that carries loss (the "
                              "loss mask marks only prompts): each conversation needs an assistant turn, or prepare "
                              "it again with scripts/prepare_text.py --loss all")
    return splits[0], splits[1]
