"""A decoder-only transformer trained on next-token prediction: gpt_tiny (bytes) and gpt2_small.

The model is the GPT-2 layout: pre-norm blocks of causal self-attention
(``F.scaled_dot_product_attention(is_causal=True)``) and a 4× MLP, learned positions,
output head tied to the token embedding, over a vocabulary of ``recipe.model.vocab``
tokens (256: bytes). Its settings come from ``recipe.model``, checked against ``GPTConfig``.
With ``train.activation_checkpointing=true`` each Block is recomputed in backward while training.

Data (``recipe.data.source``):
- ``text``: the bytes of the file ``recipe.data.path`` (first 90% train, last 10% test);
- ``tokens``: the token files in ``recipe.data.root`` (scripts/prepare_text.py writes them;
  recipes/tokens.py reads them, memory-mapped);
- ``synthetic``: a language generated from the seed; bytes of made-up words for vocab 256,
  otherwise a Markov chain over token ids spread across the vocabulary;
- ``auto``: text when a path is given, else synthetic.
``recipe.data.train_size``/``test_size`` count windows: how many to draw of the synthetic
language, a seeded subset of a file's or token directory's; null: all of them.
A sample is a window of ``context + 1`` tokens, stored as ``x = window[:-1]`` and
``y = window[1:]``, so the loaders gather whole windows by row like any other dataset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes.document_attention import KERNELS, DocumentMask
from recipes.subset import seeded_subset
from recipes.tokens import document_splits, dtype_for_vocab, has_documents, input_dtype, token_splits, windows
from trainer.data.packing import PackedDocuments
from trainer.step.activation_checkpointing import checkpointed
from trainer.run.errors import ConfigError
from trainer.recipe import (IGNORE_INDEX, Batch, Datasets, Recipe, Split, fused_with_top1, label_scores_highest,
                            top1_correct)
from trainer.run.runtime import Runtime

BYTES = 256  # the vocabulary of byte-level text: one token per byte
SOURCES = ("auto", "text", "tokens", "synthetic")
SYNTHETIC_TRAIN_TOKENS, SYNTHETIC_TEST_TOKENS = 1_600_000, 160_000
TEST_FRACTION = 0.1  # of a text file, taken from its end


@dataclass
class GPTConfig:
    n_layer: int = 6
    n_head: int = 6
    d_model: int = 384
    context: int = 256  # tokens per sample
    vocab: int = BYTES  # token ids are < vocab; embedding and output head rows
    dropout: float = 0.0  # attention and residual dropout while training
    layer_norm_bias: bool = True  # false: LayerNorms scale only (GPT-2 had biases; nanoGPT-style trainers drop them)


def model_config(settings) -> GPTConfig:
    """``recipe.model`` as a GPTConfig; unknown keys and bad values name the setting to change."""
    known = {f.name: f for f in fields(GPTConfig)}
    values = {}
    for key, value in dict(settings or {}).items():
        if key not in known:
            raise ConfigError(f"recipe.model.{key} is not a setting of the GPT model: remove it, or use one of "
                              f"{', '.join('recipe.model.' + k for k in known)}")
        kind = {"int": int, "float": float, "bool": bool}.get(known[key].type, known[key].type)
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"recipe.model.{key}={value!r} must be true or false")
            values[key] = value
            continue
        accepted = int if kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise ConfigError(f"recipe.model.{key}={value!r} must be {'an integer' if kind is int else 'a number'}")
        values[key] = kind(value)
    c = GPTConfig(**values)
    for key in ("n_layer", "n_head", "d_model", "context", "vocab"):
        if getattr(c, key) < 1:
            raise ConfigError(f"recipe.model.{key}={getattr(c, key)} must be at least 1")
    if c.d_model % c.n_head:
        raise ConfigError(f"recipe.model.d_model={c.d_model} is not divisible by recipe.model.n_head={c.n_head}: "
                          "change one of them")
    if not 0.0 <= c.dropout < 1.0:
        raise ConfigError(f"recipe.model.dropout={c.dropout} must be in [0, 1)")
    return c


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, documents: Optional[DocumentMask] = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head) for z in self.qkv(x).split(d, dim=2))
        if documents is not None:  # within each packed document (no dropout: refused with it)
            y = documents.attend(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0).transpose(1, 2)
        return self.resid_dropout(self.proj(y.reshape(b, t, d)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model, bias=c.layer_norm_bias)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.d_model, bias=c.layer_norm_bias)
        self.mlp = nn.Sequential(nn.Linear(c.d_model, 4 * c.d_model, bias=False), nn.GELU(),
                                 nn.Linear(4 * c.d_model, c.d_model, bias=False), nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor, documents: Optional[DocumentMask] = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), documents)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``activation_checkpointing``: each Block's forward is recomputed in backward while training."""

    def __init__(self, c: GPTConfig, activation_checkpointing: bool = False, attention_kernel: str = "auto"):
        super().__init__()
        self.config, self.activation_checkpointing = c, activation_checkpointing
        self.attention_kernel = attention_kernel  # within documents: recipes/document_attention.py KERNELS
        self.tok_emb = nn.Embedding(c.vocab, c.d_model)
        self.pos_emb = nn.Embedding(c.context, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model, bias=c.layer_norm_bias)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one matrix embeds and un-embeds
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draws every weight in place: at construction, and after a meta-device build is sharded and
        allocated (train.fsdp.init=meta, Recipe.init_weights). The same draws, in the same order, either way."""
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()
        self.apply(self._init)
        for block in self.blocks:  # residual branches scaled down so the stream's variance stays put
            for w in (block.attn.proj.weight, block.mlp[2].weight):
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * self.config.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T]. Packed documents (trainer/data/packing.py) pass each
        token's ``position_ids`` within its document and, for attention within each document, their
        ``document_ids`` and ``cu_seqlens`` (recipes/document_attention.py); without them attention is causal
        over the whole row."""
        pos = torch.arange(idx.shape[1], device=idx.device) if position_ids is None else position_ids
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        documents = None if document_ids is None else DocumentMask.build(document_ids, cu_seqlens,
                                                                         self.attention_kernel)
        for block in self.blocks:
            x = checkpointed(block, x, documents) if self.activation_checkpointing else block(x, documents)
        return self.head(self.ln_f(x))

    def training_flops_per_token(self) -> float:
        """6 FLOPs per parameter per token (forward + backward), plus attention's 12·L·d·T.

        Position embeddings are left out (a lookup, not a matmul); the tied embedding is
        counted once, as the output head it also is.
        """
        c = self.config
        n_params = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        return 6.0 * n_params + 12.0 * c.n_layer * c.d_model * c.context


def synthetic_text(seed: int, n_bytes: int) -> bytes:
    """``n_bytes`` of a made-up language with structure a small model can learn.

    A vocabulary of 400 words (2 to 8 letters, letters drawn with skewed frequencies);
    sentences follow a first-order Markov chain in which each word has six possible
    successors with fixed, decreasing probabilities, and ends with probability 1/8.
    Spelling is deterministic given the word, so most bytes are predictable from the
    bytes before them; the word choices carry the remaining uncertainty.
    """
    rng = np.random.default_rng(seed)
    n_words, n_next = 400, 6
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    letter_p = rng.dirichlet(np.full(26, 1.5))
    words = [b" " + rng.choice(letters, size=int(n), p=letter_p).tobytes()
             for n in rng.integers(2, 9, n_words)]
    end = n_words
    words.append(b".\n")
    popularity = np.arange(1, n_words + 1) ** -0.7  # Zipf-like: some words follow many others
    successors = [rng.choice(n_words, size=n_next, replace=False, p=popularity / popularity.sum()).tolist()
                  for _ in range(n_words + 1)]
    slot_p = 1.0 / np.arange(1, n_next + 1)
    slot_cdf = np.cumsum(slot_p / slot_p.sum())

    out, total = [], 0
    while total < n_bytes:  # chunks of words until enough bytes (6 bytes per word on average)
        n = n_bytes // 5 + 1024
        slots = np.minimum(np.searchsorted(slot_cdf, rng.random(n)), n_next - 1).tolist()
        ends = (rng.random(n) < 1 / 8).tolist()
        word = end
        for slot, stop in zip(slots, ends):
            word = end if stop and word != end else successors[word][slot]
            out.append(words[word])
            total += len(words[word])
    return b"".join(out)[:n_bytes]


def synthetic_token_ids(seed: int, n_tokens: int, vocab: int) -> np.ndarray:
    """``n_tokens`` ids of a made-up language over a vocabulary of ``vocab`` tokens (int64).

    Its words are single token ids drawn without replacement from the whole range
    [0, vocab) (up to 4096 of them, one of which ends a sentence), so the embedding and
    the head see rows across the vocabulary. Word order is the byte language's: a
    first-order Markov chain in which each word has six possible successors, chosen with
    Zipf-like popularity and taken with fixed, decreasing probabilities; a sentence ends
    with probability 1/8. The best possible loss is about 1.75 nats per token, far below
    chance (ln vocab). Deterministic in ``seed``; generated as many chains side by side.
    """
    rng = np.random.default_rng(seed)
    n_words = min(vocab - 1, 4096)
    if n_words < 2:
        raise ConfigError(f"recipe.model.vocab={vocab} is too small for the synthetic language: use at least 3")
    ids = rng.choice(vocab, size=n_words + 1, replace=False)  # ids[n_words] ends a sentence
    end, n_next = n_words, min(6, n_words)
    popularity = np.arange(1, n_words + 1) ** -0.7
    successors = np.stack([rng.choice(n_words, size=n_next, replace=False, p=popularity / popularity.sum())
                           for _ in range(n_words + 1)])
    slot_p = 1.0 / np.arange(1, n_next + 1)
    slot_cdf = np.cumsum(slot_p / slot_p.sum())

    chain_length = 512
    n_chains = -(-n_tokens // chain_length)
    words = np.empty((n_chains, chain_length), dtype=np.int64)
    word = np.full(n_chains, end)
    words[:, 0] = word  # each chain starts a sentence: joined end to end, they read as one text
    for t in range(1, chain_length):  # every chain steps at once
        slot = np.minimum(np.searchsorted(slot_cdf, rng.random(n_chains)), n_next - 1)
        stop = (rng.random(n_chains) < 1 / 8) & (word != end)
        word = np.where(stop, end, successors[word, slot])
        words[:, t] = word
    return ids[words.reshape(-1)[:n_tokens]]


def as_tokens(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)  # byte-level: one token per byte


def synthetic_splits(seed: int, context: int, train_size: int, test_size: int,
                     vocab: int = BYTES) -> Tuple[Split, Split]:
    """``train_size`` and ``test_size`` windows of the synthetic language for this vocabulary.

    Bytes of made-up words for the byte vocabulary; token ids across the vocabulary otherwise.
    """
    n = train_size * context + 1 + test_size * context + 1
    if vocab == BYTES:
        tokens = as_tokens(synthetic_text(seed, n))
    else:
        tokens = torch.from_numpy(synthetic_token_ids(seed, n, vocab).astype(input_dtype(dtype_for_vocab(vocab))))
    cut = train_size * context + 1
    return windows(tokens[:cut], context), windows(tokens[cut:], context)


def check_text_file(path: str, context: int) -> None:
    """A given file must exist and hold one test window: say so before any rank reads it."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"recipe.data.path={path!r} is not a file: set recipe.data.path to a text file, "
                          "or recipe.data.path=null for the synthetic language")
    size = file.stat().st_size
    if int(size * TEST_FRACTION) < context + 1:
        raise ConfigError(f"recipe.data.path={path!r} has {size} bytes: its last {TEST_FRACTION:.0%} (the test "
                          f"split) holds no window of recipe.model.context={context} + 1 bytes; use a longer "
                          "file or a smaller recipe.model.context")


def text_file_splits(path: str, context: int) -> Tuple[Split, Split]:
    """The file's bytes as tokens: the first 90% for training, the rest for testing."""
    tokens = as_tokens(Path(path).expanduser().read_bytes())
    cut = int(len(tokens) * (1 - TEST_FRACTION))
    return windows(tokens[:cut], context), windows(tokens[cut:], context)


def preprocess(batch: Batch, train: bool) -> Batch:
    return {**batch, "x": batch["x"].long()}  # stored as uint8 bytes or int32 ids: 8x or 2x less memory


def next_token_criterion(label_smoothing: float = 0.0):
    """Cross-entropy of each next token, from logits [B, T, vocab] computed in fp32; with it, in one function
    for the compiled step, its mean and top1_correct (``with_top1``: next_token_loss_and_top1)."""

    def criterion(logits: torch.Tensor, target: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction=reduction,
                               label_smoothing=label_smoothing)
        return loss.view_as(target) if reduction == "none" else loss

    return fused_with_top1(criterion, next_token_loss_and_top1(label_smoothing))


def next_token_loss_and_top1(label_smoothing: float = 0.0):
    """``next_token_criterion``'s mean (or sum: ``reduction="sum"``) and ``top1_correct`` in one function (its
    ``with_top1``), both from one row maximum of the fp32 logits. Compiled, Inductor computes that maximum in the
    loss's own pass over the logits (its online softmax), where ``top1_correct`` beside the loss costs a pass of
    its own (gpt2_small, 16 x 1024 tokens on an H200: 0.5 ms of a 33 ms step). The arithmetic is the decomposition
    of ``F.cross_entropy`` (log-softmax, then the label's negative, averaged or summed over the labels not -100;
    label smoothing as torch adds it), so the loss is the criterion's to rounding; the correctness is
    ``top1_correct``'s, bit for bit: argmax's, the label's logit equal to the row's maximum and every logit
    before it below (``label_scores_highest``; that masked maximum is read in the same pass)."""

    def loss_and_correct(logits: torch.Tensor, target: torch.Tensor,
                         reduction: str = "mean") -> Tuple[torch.Tensor, torch.Tensor]:
        x, labels = logits.flatten(0, 1).float(), target.flatten()
        best = x.amax(dim=1, keepdim=True)
        shifted = x - best.detach()  # the maximum only shifts: no gradient through it, as in log_softmax's
        log_probs = shifted - shifted.exp().sum(dim=1, keepdim=True).log()
        loss = F.nll_loss(log_probs, labels, reduction=reduction)
        if label_smoothing > 0:
            kept = labels != IGNORE_INDEX
            smooth = torch.where(kept, -log_probs.sum(dim=1), 0.0).sum()
            if reduction == "mean":
                smooth = smooth / kept.sum()
            loss = (1 - label_smoothing) * loss + smooth * (label_smoothing / x.shape[1])
        return loss, label_scores_highest(x, labels, best.squeeze(1)).view_as(target)

    return loss_and_correct


def language_data(data_cfg, seed: int, context: int, vocab: int, vocab_key: str = "recipe.model.vocab",
                  max_loss: Optional[int] = None, loss_key: str = "max_loss_tokens") -> Datasets:
    """The samples that ``recipe.data`` names (its source: text, tokens, synthetic or auto), for a model of
    ``vocab`` tokens; ``vocab_key`` is the setting that sizes it, named in messages. ``max_loss``: the most loss
    tokens a packed row may carry (setting ``loss_key``), for documents only.

    Token files with document boundaries (scripts/prepare_text.py --input documents|jsonl|chat|pairs) give
    packed rows of whole documents (trainer/data/packing.py: fields x, y, position_ids, document_ids,
    cu_seqlens); everything else, windows of ``context + 1`` tokens of one stream, every one whole."""
    source = data_cfg.source
    if source not in SOURCES:
        raise ConfigError(f"recipe.data.source={source!r} is not one of {', '.join(SOURCES)}: "
                          "set recipe.data.source=auto")
    if source == "auto":  # a file given: read it; none: the synthetic language, quietly
        source = "synthetic" if data_cfg.path is None else "text"
    for key, default in (("crop_scale", None), ("eval_resize_ratio", 0.875)):
        if data_cfg[key] != default:
            raise ConfigError(f"recipe.data.{key}={data_cfg[key]} is read by the image recipes' folders only, and "
                              "this recipe reads text: remove it")
    if data_cfg.path is not None and source != "text":
        raise ConfigError(f"recipe.data.path={data_cfg.path!r} but recipe.data.source={source}: set "
                          "recipe.data.source=text (or auto) to read the file, or recipe.data.path=null")
    stats = {}
    documents = source == "tokens" and has_documents(data_cfg.root)
    if max_loss is not None and not documents:
        raise ConfigError(f"{loss_key}={max_loss} bounds the loss tokens of packed rows of documents, and "
                          f"recipe.data.source={source} gives windows of one stream, every token a loss token: "
                          f"set {loss_key}=null, or train on documents (token files that scripts/prepare_text.py "
                          "wrote with --input documents, jsonl, chat or pairs, in recipe.data.root)")
    if documents:
        if data_cfg.seq_len_buckets:
            raise ConfigError("recipe.data.seq_len_buckets cuts rows short, which would cut packed documents: "
                              f"remove it (recipe.data.root={data_cfg.root!r} holds documents)")
        train, test = document_splits(data_cfg.root, context, vocab, seed=seed,
                                      split_long=data_cfg.split_long_documents, max_loss=max_loss,
                                      vocab_key=vocab_key, split_key="recipe.data.split_long_documents",
                                      context_key="recipe.model.context", loss_key=loss_key)
        print(train.describe(), flush=True)
        stats = packing_stats(train)
    elif source == "tokens":
        train, test = token_splits(data_cfg.root, context, vocab, vocab_key=vocab_key)
    elif source == "text":
        if data_cfg.path is None:
            raise ConfigError("recipe.data.source=text needs a file to read: set recipe.data.path=<text file> "
                              "(or recipe.data.source=synthetic)")
        check_text_file(data_cfg.path, context)
        if vocab < BYTES:
            raise ConfigError(f"recipe.data.path is read as bytes (token ids 0 to 255) but {vocab_key}={vocab}: "
                              f"set {vocab_key}={BYTES} or more")
        train, test = text_file_splits(data_cfg.path, context)
    else:
        train_size = data_cfg.train_size or SYNTHETIC_TRAIN_TOKENS // context
        test_size = data_cfg.test_size or SYNTHETIC_TEST_TOKENS // context
        return Datasets(*synthetic_splits(seed, context, train_size, test_size, vocab), source)
    where = f"recipe.data.path={data_cfg.path!r}" if source == "text" else f"recipe.data.root={data_cfg.root!r}"
    return Datasets(*(seeded_subset(dataset, size, split=split, seed=seed, where=f"the {split} split of {where}")
                      for split, dataset, size in (("train", train, data_cfg.train_size),
                                                   ("test", test, data_cfg.test_size))), source, stats)


def packing_stats(train: PackedDocuments) -> dict:
    """The training split's packing, for results.json and W&B (trainer.recipe.Datasets.stats)."""
    return {"data/padding_fraction": train.padding_fraction, "data/documents": len(train.documents),
            "data/rows": len(train), "data/documents_cut": train.plan.split_documents,
            "data/real_tokens": int(train.real_tokens.sum()), "data/loss_tokens": int(train.loss_tokens.sum()),
            **({"data/loss_tokens_per_row_bound": train.max_loss,
                "data/cuts_for_loss_bound": train.plan.cut_for_loss} if train.max_loss is not None else {})}


ATTENTION = ("auto", "document", "causal")


def is_packed(data: Datasets) -> bool:
    """Whether the samples are packed documents (rows with boundaries), not windows of one stream."""
    train = data.train.dataset if isinstance(data.train, torch.utils.data.Subset) else data.train
    return isinstance(train, PackedDocuments)


def attention_mode(data_cfg, packed: bool) -> str:
    """``recipe.data.attention`` resolved: "document" (within each packed document) or "causal" (over the whole
    row or window). auto: document where the data has boundaries."""
    attention = data_cfg.attention
    if attention not in ATTENTION:
        raise ConfigError(f"recipe.data.attention={attention!r} is not one of {', '.join(ATTENTION)}: "
                          "set recipe.data.attention=auto")
    if attention == "document" and not packed:
        raise ConfigError("recipe.data.attention=document needs document boundaries, which this data has none of: "
                          "prepare token files with `python scripts/prepare_text.py INPUT... --input documents "
                          "--output DIR` (or jsonl, chat, pairs) and set recipe.data.source=tokens "
                          "recipe.data.root=DIR, or set recipe.data.attention=causal")
    if not data_cfg.split_long_documents and not packed:
        raise ConfigError("recipe.data.split_long_documents=false is read for data with document boundaries only "
                          "(token files from prepare_text.py --input documents|jsonl|chat|pairs): remove it")
    resolved = "causal" if attention == "auto" and not packed else ("document" if attention == "auto" else attention)
    kernel = data_cfg.attention_kernel
    if kernel not in KERNELS:
        raise ConfigError(f"recipe.data.attention_kernel={kernel!r} is not one of {', '.join(KERNELS)}: "
                          "set recipe.data.attention_kernel=auto")
    if kernel != "auto" and resolved != "document":
        raise ConfigError(f"recipe.data.attention_kernel={kernel} is the kernel of attention within documents, and "
                          f"this run attends causally ({'recipe.data.attention=causal' if packed else 'no documents'}): "
                          "remove it")
    return resolved


def check_attention_kernel(cfg, rt: Optional[Runtime]) -> None:
    """The kernel named for attention within documents runs here: flex and varlen train on CUDA only (FlexAttention
    has no CPU backward, varlen is flash); deterministic=true promises the same bits every run, which varlen's
    backward cannot keep (flash adds each query block's gradient with atomics)."""
    kernel = cfg.recipe.data.attention_kernel
    device = rt.device if rt is not None else torch.device("cpu")
    if kernel in ("flex", "varlen") and device.type != "cuda":
        raise ConfigError(f"recipe.data.attention_kernel={kernel} trains on CUDA GPUs only, and this run is on "
                          f"{device.type}: set recipe.data.attention_kernel=auto (dense here)")
    if cfg.deterministic and kernel == "varlen":
        raise ConfigError("recipe.data.attention_kernel=varlen: its backward is not deterministic (flash adds the "
                          "query gradients with atomics), and deterministic=true asks for the same bits every run: "
                          "set recipe.data.attention_kernel=flex (or auto), or deterministic=false")


def packed_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``Recipe.forward`` for packed rows attended causally across the row: positions restart per document."""
    return model(batch["x"], batch["position_ids"])


def document_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``Recipe.forward`` for packed rows attended within each document."""
    return model(batch["x"], batch["position_ids"], batch["document_ids"], batch["cu_seqlens"])


def build(cfg, rt: Runtime) -> Recipe:
    config = model_config(cfg.recipe.model)
    data = language_data(cfg.recipe.data, cfg.seed, config.context, config.vocab)
    packed = is_packed(data)
    attention = attention_mode(cfg.recipe.data, packed)
    if attention == "document":
        check_attention_kernel(cfg, rt)
    if attention == "document" and config.dropout > 0:
        raise ConfigError(f"recipe.model.dropout={config.dropout}: attention within documents has no dropout; set "
                          "recipe.model.dropout=0, or recipe.data.attention=causal")
    with torch.device(rt.init_device):  # the meta device under train.fsdp.init=meta: nothing allocated
        model = GPT(config, activation_checkpointing=cfg.train.activation_checkpointing,
                    attention_kernel=cfg.recipe.data.attention_kernel)
    return Recipe(name=cfg.recipe.name, model=model, data=data, preprocess=preprocess,
                  criterion=next_token_criterion(cfg.recipe.label_smoothing), correct=top1_correct,
                  forward=(document_forward if attention == "document" else packed_forward) if packed else None,
                  loss_average="labels" if packed else "micro_batch",
                  units_per_sample=config.context, unit="tokens", flops_per_unit=model.training_flops_per_token(),
                  activation_checkpointing=model.activation_checkpointing, label_smoothing=cfg.recipe.label_smoothing,
                  blocks=list(model.blocks), init_weights=GPT.init_weights)
