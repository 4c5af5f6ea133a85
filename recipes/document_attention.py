"""Attention kept inside each document of a packed row: causal within a document, nothing across.

Packed rows (trainer/data/packing.py) carry where their documents lie in two static forms, both written
in place each step so that one captured graph serves every batch:

- ``document_ids`` [batch, context] int32: the document (0, 1, ...) of each position; padding is -1;
- ``cu_seqlens`` [batch, max_documents + 2] int32: 0, each segment's end, then ``context`` (unused entries).

``DocumentMask.build`` turns them, once per forward, into what a kernel reads; every layer's attention
then calls ``attend``. The kernels (``KERNELS``):

- ``dense``: SDPA with a boolean [batch, 1, T, T] mask. The reference: any device, any dtype, exact
  (CPU tests compare every other path with it), but T x T memory and no flash kernel.
- ``flex``: FlexAttention with its block mask built on the device from ``document_ids``, compiled
  (an uncompiled flex_attention materializes the scores); skips the blocks no document reaches.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash, variable length) over the batch's rows laid
  end to end, with one ``cu_seqlens`` for all of them; causal is its ``window_size=(-1, 0)``. Grouped-query
  attention (fewer key/value heads) passes ``enable_gqa`` where the installed torch has it, else repeats
  the key/value heads.
``auto`` is ``dense`` off CUDA and ``AUTO_CUDA_KERNEL`` on it (scripts/bench_document_attention.py
measures both). Padding (-1) attends to padding only, so no row of the mask is empty.

Layout: queries [B, T, Hq, D], keys and values [B, T, Hkv, D] (a transformer's projections before the
head transpose); the output is [B, T, Hq, D]. Everything here is graph-safe: static shapes, no host sync.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from trainer.data.packing import flatten_cu_seqlens

KERNELS = ("auto", "dense", "flex", "varlen")
AUTO_CUDA_KERNEL = "flex"


def resolve_kernel(kernel: str, device: torch.device) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"document attention kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "auto":
        return AUTO_CUDA_KERNEL if device.type == "cuda" else "dense"
    return kernel


@dataclass
class DocumentMask:
    """What one forward's attention layers read: the kernel and its form of the documents' layout."""
    kernel: str
    batch: int
    context: int
    mask: Any  # dense: bool [B, 1, T, T]; flex: a BlockMask; varlen: int32 cu_seqlens of the flattened batch

    @staticmethod
    def build(document_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor], kernel: str = "auto") -> "DocumentMask":
        batch, context = document_ids.shape
        kernel = resolve_kernel(kernel, document_ids.device)
        if kernel == "dense":
            mask = dense_document_mask(document_ids)[:, None]
        elif kernel == "flex":
            mask = flex_block_mask(document_ids)
        else:
            if cu_seqlens is None:
                raise ValueError("varlen document attention needs the rows' cu_seqlens")
            mask = flatten_cu_seqlens(cu_seqlens, context)
        return DocumentMask(kernel, batch, context, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
        """Attention of ``q`` [B, T, Hq, D] over ``k``, ``v`` [B, T, Hkv, D] within each document: [B, T, Hq, D]."""
        gqa = q.shape[2] != k.shape[2]
        q, k, v = autocast_inputs(q, k, v)
        if self.kernel == "varlen":
            return varlen_document_attention(q, k, v, self.mask, self.context, scale)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kernel == "dense":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale, enable_gqa=gqa)
        else:
            out = flex_attention_kernel()(q, k, v, block_mask=self.mask, scale=scale, enable_gqa=gqa,
                                          kernel_options=flex_kernel_options(q))
        return out.transpose(1, 2)


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: query i sees key j when both are in one document and j <= i."""
    t = document_ids.shape[1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return same & torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()


def flex_attention_kernel():
    """The flex_attention to call here: inside a model being compiled, the plain function (Dynamo traces it
    into the model's graph and Inductor fuses it there; calling the lru_cache'd compiled one from inside a
    trace only earns a warning per run); outside, the one compiled for this process."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention
    return compiled_flex_attention()


# FlexAttention's backward tiles where Inductor's default for the GPU and head size was measured slower than the
# tiles its own max-autotune picks: (compute capability, head dim) -> kernel_options. H100/H200 at head dim 64
# (Qwen2-0.5B, GPT-2): the default is 64/128/128/64 with 8 warps (torch's table puts 64 with the larger heads);
# max-autotune picks 64 x 4 with 4 warps and 3 stages: 11% less backward time at bench_trl's 0.5b shape alone, 1.3 ms
# of its 132.7 ms step (scripts/results/RESULTS.md, 2026-12-03).
FLEX_BACKWARD_TILES = {
    ((9, 0), 64): {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                   "bwd_num_warps": 4, "bwd_num_stages": 3},
}


def flex_kernel_options(q: torch.Tensor) -> Optional[dict]:
    """The kernel_options for flex_attention over queries ``q`` (..., D): FLEX_BACKWARD_TILES' entry for this GPU and
    head size in half precision, else None (Inductor's own choice). The tiles shape only the kernels' speed."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    return FLEX_BACKWARD_TILES.get((cuda_capability(q.device.index), q.shape[-1]))


@torch.compiler.assume_constant_result
def cuda_capability(index: Optional[int]) -> tuple:
    """(major, minor) of a CUDA device; a constant to Dynamo, so a compiled model reads it without a graph break."""
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def compiled_flex_attention():
    """flex_attention compiled once per process: its fused kernel (uncompiled, it computes every score)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=None)
def _compiled_block_mask_builder():
    from torch.nn.attention.flex_attention import create_block_mask

    def build(document_ids: torch.Tensor):
        def same_document_causal(b, h, q, kv):
            return (document_ids[b, q] == document_ids[b, kv]) & (q >= kv)

        batch, context = document_ids.shape
        return create_block_mask(same_document_causal, batch, None, context, context, device=document_ids.device)

    return torch.compile(build, dynamic=False, fullgraph=True)


@torch.compiler.disable
def flex_block_mask(document_ids: torch.Tensor):
    """FlexAttention's block mask of document-causal attention over ``document_ids`` [B, T], built on the
    device by its own compiled function (no host sync: it can sit inside a captured step). Inside a compiled
    model (graph.compile_model) too: traced with the model, Inductor fused the mask's sort and sums into the
    attention kernel of evaluation's forward, and on an H200 that kernel faulted (CUDA's "operation not
    supported on global/shared address space", gpt_tiny on documents, torch 2.11). Built here, the mask
    reaches the compiled model as an input, as FlexAttention's own examples pass it."""
    return _compiled_block_mask_builder()(document_ids)


def autocast_inputs(*tensors: torch.Tensor):
    """The inputs in autocast's dtype where autocast is on and they are wider, as SDPA takes them: Flash varlen
    accepts only fp16 and bf16, and a model's rotary embedding can hand fp32 queries to attention under bf16
    autocast (Qwen2's does); flex would otherwise run the whole attention in fp32."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype.itemsize > dtype.itemsize else t for t in tensors)


@functools.lru_cache(maxsize=None)
def varlen_takes_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              context: int, scale: Optional[float] = None) -> torch.Tensor:
    """Flash variable-length attention over the batch's rows end to end; ``cu_seqlens``: flatten_cu_seqlens'.
    ``max_q``/``max_k`` are the context: a bound that holds for every batch, so the call's shape never changes."""
    from torch.nn.attention.varlen import varlen_attn

    b, t, hq, d = q.shape
    hkv = k.shape[2]
    gqa = {}
    if hq != hkv:
        if varlen_takes_gqa():
            gqa = {"enable_gqa": True}
        else:  # torch 2.11's varlen_attn has no grouped-query form: each key/value head serves its group
            k, v = (t_.repeat_interleave(hq // hkv, dim=2) for t_ in (k, v))
    flat = [t_.reshape(b * t, t_.shape[2], d) for t_ in (q, k, v)]
    out = varlen_attn(*flat, cu_seqlens, cu_seqlens, context, context, scale=scale, window_size=(-1, 0), **gqa)
    return out.view(b, t, hq, d)
