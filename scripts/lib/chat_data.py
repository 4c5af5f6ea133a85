"""The conversations, tokenizer and model of scripts/bench_trl.py, made here from a seed: nothing is downloaded.

    write_conversations(Path("chats.jsonl"), count=4000, seed=0)        # JSON Lines of {"messages": [...]}
    tokenizer_directory(Path("tokenizer"), Path("chats.jsonl"))         # trained on them, ChatML, saved
    model_directory(Path("model"), "0.5b")                              # Qwen2-0.5B's shape, random weights

A conversation is a system turn and 1-4 user/assistant exchanges of words from a made-up vocabulary (drawn by a
Zipf law, so a model has something to learn). Its length in tokens, rendered by the chat template, is drawn
lognormally around ``MEDIAN_TOKENS`` (sigma ``SIGMA``) and capped: the tokenizer is word-level, so every word is one
token and every turn adds three (``<|im_start|>``, the role, ``<|im_end|>``), which makes the rendered length exact.

The tokenizer speaks ChatML. Its chat template wraps each assistant turn's content and its ``<|im_end|>`` in
``{% generation %}`` markers (TRL's ``assistant_only_loss`` reads them through ``apply_chat_template``'s assistant
mask), and its ``eos_token`` is ``<|im_end|>``, as a Qwen2 chat model's is: scripts/prepare_text.py then appends no
end-of-text of its own after a conversation (it ends with one), so both sides train on the same tokens and the same
loss tokens (each assistant turn's content and its ``<|im_end|>``). ``<|endoftext|>`` is the padding token.

Models keep their real vocabulary (151,936 for the Qwen2 shapes: the logits cost what they cost) although the
tokenizer uses a few thousand ids; ``tiny`` is a CPU model for tests.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np

MEDIAN_TOKENS = 300
SIGMA = 1.0  # lognormal spread of the rendered lengths (trainer/data/packing.py measures its padding at this spread)
SHORTEST = 32  # tokens: a system turn and one exchange of a few words each
LONGEST = 4096  # the default cap: the benchmark's context
WORDS = 2500  # the made-up vocabulary
TOKENS_PER_TURN = 3  # <|im_start|>, the role, <|im_end|>
END_OF_TURN, PAD, START = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
UNKNOWN = "[UNK]"
SPECIAL_TOKENS = [UNKNOWN, PAD, START, END_OF_TURN]
ROLES = ("system", "user", "assistant")
# ChatML with the assistant's content and end of turn inside {% generation %}: what its assistant mask marks.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 model's shape: transformers' Qwen2Config settings of those names."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True


SIZES: Dict[str, ModelShape] = {
    "tiny": ModelShape(64, 2, 4, 2, 128, 4096),  # CPU tests: a vocabulary just above the tokenizer's
    "0.5b": ModelShape(896, 24, 14, 2, 4864, 151936),  # Qwen2-0.5B
    "1.5b": ModelShape(1536, 28, 12, 2, 8960, 151936),  # Qwen2-1.5B
}


def made_up_words(count: int, seed: int) -> List[str]:
    """``count`` distinct pronounceable words of two to four syllables, none a role name."""
    rng = np.random.default_rng(seed)
    onsets = list("bdfgklmnprstvz") + ["ch", "sh", "th", "tr", "br", "pl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    words: Dict[str, None] = {}
    while len(words) < count:
        syllables = int(rng.integers(2, 5))
        word = "".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))] for _ in range(syllables))
        if word not in ROLES:
            words[word] = None
    return list(words)


def rendered_lengths(count: int, seed: int, longest: int = LONGEST) -> np.ndarray:
    """Each conversation's length in tokens as the chat template renders it: lognormal around MEDIAN_TOKENS."""
    rng = np.random.default_rng([seed, 1])
    return np.clip(np.round(rng.lognormal(np.log(MEDIAN_TOKENS), SIGMA, count)), SHORTEST, longest).astype(np.int64)


def conversations(count: int, seed: int = 0, longest: int = LONGEST) -> Iterator[dict]:
    """``count`` conversations, each ``{"messages": [...]}`` (system, then 1-4 user/assistant exchanges) whose rendered
    length is ``rendered_lengths``' to the token. The words of a turn: assistants write about three times what users do."""
    words = np.array(made_up_words(WORDS, seed))
    zipf = np.cumsum(1.0 / np.arange(1, len(words) + 1))
    zipf /= zipf[-1]  # the cumulative law: a uniform draw searched in it picks a word
    rng = np.random.default_rng([seed, 2])
    for total in rendered_lengths(count, seed, longest):
        exchanges = int(rng.integers(1, 5))
        roles = ["system"] + ["user", "assistant"] * exchanges
        content = int(total) - TOKENS_PER_TURN * len(roles)
        while content < len(roles):  # too short for this many turns: fewer exchanges
            roles = roles[:-2]
            content = int(total) - TOKENS_PER_TURN * len(roles)
        weights = rng.dirichlet([{"system": 1.0, "user": 2.0, "assistant": 6.0}[r] for r in roles])
        counts = 1 + rng.multinomial(content - len(roles), weights)  # every turn at least one word
        yield {"messages": [{"role": role, "content": " ".join(words[np.searchsorted(zipf, rng.random(n))])}
                            for role, n in zip(roles, counts)]}


def write_conversations(path: Path, count: int, seed: int = 0, longest: int = LONGEST) -> Path:
    """``conversations`` as JSON Lines at ``path`` (written whole, then renamed: a file there is complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as f:
        for record in conversations(count, seed, longest):
            f.write(json.dumps(record) + "\n")
    partial.replace(path)
    return path


def tokenizer_directory(directory: Path, conversations_file: Path) -> Path:
    """A word-level tokenizer trained on the words of ``conversations_file``, with ChatML's tokens and
    ``CHAT_TEMPLATE``, saved by ``PreTrainedTokenizerFast.save_pretrained`` into ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts() -> Iterator[str]:
        yield " ".join(ROLES)
        with open(conversations_file) as f:
            for line in f:
                yield " ".join(m["content"] for m in json.loads(line)["messages"])

    tokenizer = Tokenizer(models.WordLevel(unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # the template's newlines make no token
    tokenizer.train_from_iterator(texts(), trainers.WordLevelTrainer(vocab_size=WORDS + 64,
                                                                     special_tokens=SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=UNKNOWN, eos_token=END_OF_TURN,
                                   pad_token=PAD, additional_special_tokens=[START])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory


def qwen2_config(size: str):
    """transformers' Qwen2Config of ``size`` (SIZES): full attention in every layer, as Qwen2's configs say."""
    from transformers import Qwen2Config

    shape = SIZES[size]
    return Qwen2Config(**vars(shape), max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, attention_dropout=0.0,
                       pad_token_id=None, bos_token_id=None, eos_token_id=None)


def model_directory(directory: Path, size: str, seed: int = 0) -> Path:
    """A Qwen2 model of ``size`` with random weights (transformers' own initialization, seeded), saved by
    ``save_pretrained`` as bf16 safetensors into ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen2_config(size), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory

