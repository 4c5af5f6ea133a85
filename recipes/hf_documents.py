"""Packed documents through a transformers model: positions per document, attention within each one.

Packed rows (trainer/data/packing.py) reach the model as ``model(input_ids, position_ids=...)``: RoPE (or
learned positions) sees each document's own positions. For attention within each document the model's
attention implementation is switched to :data:`DOCUMENT_ATTENTION`, registered through transformers'
``AttentionInterface`` with no mask function beside it, so transformers builds no mask of its own (nor
guesses packing from the positions, which it does only outside capture and compilation); the step builds
one ``DocumentMask`` per forward (recipes/document_attention.py) and passes it down as the keyword
``document_mask``, which transformers hands each attention layer with its other keywords.
"""
from __future__ import annotations

from typing import Optional

import torch

from recipes.document_attention import DocumentMask
from trainer.recipe import Batch
from trainer.run.errors import ConfigError

DOCUMENT_ATTENTION = "document_attention"
# Attention keywords a layer may pass that this implementation would have to honour: refused, never dropped.
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")


def document_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                               dropout: float = 0.0, document_mask: Optional[DocumentMask] = None, **kwargs):
    """transformers' attention signature: ``query`` [B, Hq, T, D], ``key``/``value`` [B, Hkv, T, D]; returns
    ([B, T, Hq, D], no weights)."""
    if document_mask is None:
        raise RuntimeError(f"attention implementation {DOCUMENT_ATTENTION!r} needs the keyword document_mask (a "
                           "recipes.document_attention.DocumentMask) in the model's call: see recipes/hf_documents.py")
    used = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if used or dropout:
        raise ConfigError(f"{type(module).__name__} asks attention for {', '.join(used) or 'dropout'}, which attention "
                          "within documents does not do: set recipe.data.attention=causal")
    out = document_mask.attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scaling)
    return out, None


def use_document_attention(model: torch.nn.Module, transformers, plain_causal: bool) -> None:
    """Switches ``model`` to :data:`DOCUMENT_ATTENTION`; a model whose attention is more than causal (a sliding
    window, chunks, soft-capping, attention dropout) is refused, naming the setting."""
    config = model.config
    reasons = [] if plain_causal else ["its mask is more than causal (a sliding window, chunks or no causality)"]
    if getattr(config, "attn_logit_softcapping", None):
        reasons.append(f"attn_logit_softcapping={config.attn_logit_softcapping}")
    for key in ("attention_dropout", "attn_pdrop"):  # Llama-style and GPT-2-style names
        if getattr(config, key, 0.0):
            reasons.append(f"{key}={getattr(config, key)}")
    if reasons:
        raise ConfigError(f"recipe.data.attention=document: {config.model_type}'s attention cannot be kept within "
                          f"documents as it is ({'; '.join(reasons)}): set recipe.data.attention=causal")
    transformers.AttentionInterface.register(DOCUMENT_ATTENTION, document_attention_forward)  # idempotent
    model.set_attn_implementation(DOCUMENT_ATTENTION)


def packed_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``Recipe.forward`` for packed rows attended causally across the row: positions restart per document."""
    return model(batch["x"], position_ids=batch["position_ids"]).logits


def document_logits(model: torch.nn.Module, batch: Batch, kernel: str = "auto") -> torch.Tensor:
    """``Recipe.forward`` for packed rows attended within each document (one mask per forward, for every layer)."""
    mask = DocumentMask.build(batch["document_ids"], batch["cu_seqlens"], kernel)
    return model(batch["x"], position_ids=batch["position_ids"], document_mask=mask).logits
