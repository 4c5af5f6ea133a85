"""The Llama 3 shapes that scripts/bench_torchtitan.py trains on both sides, their parameter counts, the one
FLOP formula both sides' MFU is computed with, and the transformers config that builds each shape here.

The shapes were read off torchtitan 0.2.2's source (``torchtitan/models/llama3``): its ``8B`` flavour
(width 4096, 32 layers, 32 heads sharing 8 key/value heads, feed-forward size from ``ffn_dim_multiplier``
1.3 rounded up to a multiple of 1024: 14336), its default vocabulary of 128256 (the Llama 3 tokenizer's),
RMSNorm eps 1e-5, RoPE theta 500000 with Llama 3.1's frequency scaling (factor 8, low/high frequency
factors 1 and 4, 8192 original positions), no biases and an output head apart from the token embedding.
0.2.2 has no flavour near 1B, so ``1b`` is this file's own: 16 layers at width 2048, 32 heads sharing 8
key/value heads, feed-forward 8192 (the same rule with multiplier 1.5), everything else as 8B: Llama 3.2
1B's layout with its head untied (torchtitan's Llama 3 model has no tying), 1.50e9 parameters.
The torchtitan worker (scripts/lib/torchtitan_worker.py) checks these numbers against the model it builds.

Nothing here imports torch: the script's ``--help`` and ``--dry-run`` use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

VOCAB = 128256  # torchtitan's TransformerModelArgs.vocab_size default: the Llama 3 tokenizer's
ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # torchtitan's RoPEScalingArgs defaults
MAX_POSITIONS = 131072  # torchtitan's max_seq_len default (it trims its RoPE table to the run's sequence length)

# The training settings both sides of scripts/bench_torchtitan.py use: torchtitan's Llama 3 8B preset (AdamW,
# clipping), with 10 warm-up steps then a constant LR (the preset's 200 warm-up steps and linear decay are sized
# for 1000 steps; this repo's trainer.step.schedules.Constant is the same warm-up, step for step).
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
LR_WARMUP_STEPS = 10
MAX_NORM = 1.0


@dataclass(frozen=True)
class LlamaShape:
    """One Llama 3 shape, in torchtitan's terms (TransformerModelArgs' fields)."""
    name: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_dim_multiplier: float
    multiple_of: int
    flavour: Optional[str]  # torchtitan's llama3_args key for this shape; None: 0.2.2 has none
    vocab: int = VOCAB
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def ffn_hidden(self) -> int:
        return ffn_hidden_size(self.dim, self.ffn_dim_multiplier, self.multiple_of)


def ffn_hidden_size(dim: int, multiplier: Optional[float], multiple_of: int) -> int:
    """The SwiGLU feed-forward size of Llama 3 (torchtitan's FeedForward): two thirds of 4 x dim, times the
    multiplier, rounded up to a multiple of ``multiple_of``. 4096, 1.3, 1024 -> 14336; 2048, 1.5, 1024 -> 8192."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


SHAPES: Dict[str, LlamaShape] = {
    "8b": LlamaShape("8b", dim=4096, layers=32, heads=32, kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
                     flavour="8B"),
    "1b": LlamaShape("1b", dim=2048, layers=16, heads=32, kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=1024,
                     flavour=None),
}


def parameter_count(shape: LlamaShape) -> int:
    """Every parameter: token embedding, per layer the q, k, v, o projections, the three feed-forward matrices and
    two RMSNorm weights, the final norm, and the output head (untied). 8b: 8,030,261,248; 1b: 1,498,482,688."""
    d, kv = shape.dim, shape.kv_heads * shape.head_dim
    attention = d * d + 2 * d * kv + d * d
    layer = attention + 3 * d * shape.ffn_hidden + 2 * d
    return shape.vocab * d + shape.layers * layer + d + d * shape.vocab


def embedding_parameters(shape: LlamaShape) -> int:
    """The token embedding's parameters: a lookup, no matmul (the output head, a matmul, is not among them)."""
    return shape.vocab * shape.dim


def training_flops_per_token(shape: LlamaShape, seq_len: int) -> float:
    """FLOPs of one training step per token: ``6 * (N - N_embedding) + 12 * L * d * T``.

    The one formula behind both sides' MFU. The first term: each parameter that multiplies an activation (every
    matrix, the output head included) costs 2 FLOPs per token forward and 4 backward; the token embedding is a
    lookup and is left out (RMSNorm weights, 0.004% of 8B, stay in). The second: attention's two matmuls per
    layer (Q K^T and the weighted sum of V), 2 x 2 x d x T FLOPs per token forward, x3 with backward, the whole
    T x T score matrix counted (no halving for the causal mask) and no recomputation counted (activation
    checkpointing and flash attention's backward recompute more; MFU counts the model's FLOPs, not the
    hardware's). This is what torchtitan 0.2.2 logs (``get_dense_model_nparams_and_flops``: 6 x non-embedding
    parameters + 6 x L x H x 2 x head_dim x T, and H x head_dim = d) and what this repo's results.json uses for
    ``recipe=hf_causal_lm`` (recipes/hf_causal_lm.py ``training_flops_per_token``, as recipes/gpt.py's): the
    three agree to the FLOP on these shapes, and tests/test_bench_torchtitan.py checks each against this one.
    8b at T=8192: 45.03e9 + 12.88e9 = 57.91e9 FLOPs per token.
    """
    return 6.0 * (parameter_count(shape) - embedding_parameters(shape)) + 12.0 * shape.layers * shape.dim * seq_len


def mfu_pct(tokens_per_s_per_gpu: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilization in percent: one GPU's share of the model FLOPs per second over its dense peak."""
    return 100.0 * tokens_per_s_per_gpu * flops_per_token / (peak_tflops * 1e12)


# transformers' Llama draws every Linear and embedding weight from N(0, initializer_range) and sets the norms to 1;
# with --matched-init torchtitan's side redraws its model the same way (scripts/lib/torchtitan_worker.py).
INIT_STD = 0.02


def hf_config(shape: LlamaShape) -> Dict[str, Any]:
    """The transformers LlamaConfig (``recipe.model.config`` of ``recipe=hf_causal_lm``) of ``shape``: the same
    matrices, norms and RoPE (Llama 3.1's scaled frequencies, transformers' ``rope_type: llama3``) as torchtitan's
    Transformer. transformers 5 reads RoPE from ``rope_parameters`` (``rope_theta`` inside it);
    ``max_position_embeddings`` is torchtitan's 131072, above the 8192 original positions the scaling names."""
    return {
        "model_type": "llama",
        "hidden_size": shape.dim,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "intermediate_size": shape.ffn_hidden,
        "vocab_size": shape.vocab,
        "rms_norm_eps": shape.norm_eps,
        "initializer_range": INIT_STD,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": shape.rope_theta, **ROPE_SCALING},
    }
