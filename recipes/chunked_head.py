"""A language model's head and its cross-entropy, a chunk of tokens at a time: the whole step's logits never exist.

A step of 4 x 4096 tokens over Qwen2's vocabulary of 151,936 holds logits of 16,384 x 151,936: 5 GB in bf16, their
gradient as much again. Here the head (``hidden @ weight.T``) and the loss run over ``chunk`` tokens at a time, and
each chunk's gradients (of its hidden states, and its share of the weight's) are computed in the same pass, while
its logits are at hand, as Liger's fused linear cross-entropy does: backward then only scales what forward kept, so
the head costs the FLOPs it costs unchunked (no recomputation) and its memory is one chunk's logits, the hidden
states' gradient and an fp32 gradient of the weight.

The arithmetic is the unchunked path's: the head's matmul in the hidden states' dtype (bf16 under autocast, as
the model's own ``lm_head`` runs there), the loss in fp32 from those logits (log-sum-exp, then the label's; torch's
label smoothing), labels equal to IGNORE_INDEX left out, and top-1 correctness as ``trainer.recipe.top1_correct``
judges it (argmax's, from the chunk's own maxima). Gradients reach the weight (tied to the embedding or not) and the
hidden states as autograd's: ``softmax - target`` in the logits' dtype, through the same two matmuls.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional, Tuple

import torch

from graphing.sharded import is_dtensor
from trainer.recipe import IGNORE_INDEX, fused_with_top1, label_scores_highest


def _chunk_terms(logits: torch.Tensor, target: torch.Tensor, smoothing: float):
    """(per-token losses, the rows' log-sum-exp, the kept labels' mask, correctness) of one chunk's fp32 logits."""
    best = logits.amax(dim=-1)
    lse = (logits - best.unsqueeze(-1)).exp().sum(dim=-1).log() + best
    kept = target != IGNORE_INDEX
    label = torch.where(kept, target, 0)
    loss = lse - logits.gather(-1, label.unsqueeze(-1)).squeeze(-1)
    if smoothing:
        loss = (1 - smoothing) * loss + smoothing * (lse - logits.mean(dim=-1))
    return torch.where(kept, loss, 0.0), lse, kept, label_scores_highest(logits, target, best)


def _chunk_pass(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, smoothing: float, grads: bool):
    """One chunk: (its summed loss, correctness per token, and where ``grads``, d loss / d h and d loss / d w in
    fp32). d loss / d logits is softmax minus the (smoothed) target, on kept rows only, in the logits' dtype."""
    logits = (h @ w.T).float()
    loss, lse, kept, right = _chunk_terms(logits, t, smoothing)
    if not grads:
        return loss.sum(), right, None, None
    g = _softmax_minus_target(logits, lse, t, kept, smoothing).to(h.dtype)
    return loss.sum(), right, g @ w, (g.T @ h).float()


def _softmax_minus_target(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, kept: torch.Tensor,
                          smoothing: float) -> torch.Tensor:
    """d loss / d logits in fp32: softmax minus the (smoothed) one-hot target on kept rows, 0 on the others.

    Eager, the label's -1 is a scatter into the softmax, in place (no second logits-sized temporary). Compiled,
    it is a comparison with each column's index inside one pointwise expression: Inductor then writes the result
    in one pass, where the scatter made it materialize the fp32 softmax first and read it again (measured with
    Inductor on the CPU: this part 2x faster, bit-identical)."""
    g = (logits - lse.unsqueeze(-1)).exp()
    if smoothing:
        g = g - smoothing / logits.shape[-1]
    if torch.compiler.is_compiling():
        is_label = torch.arange(logits.shape[-1], device=logits.device) == target.unsqueeze(-1)
        g = torch.where(is_label, g - (1 - smoothing), g)
    else:
        g.scatter_add_(-1, torch.where(kept, target, 0).unsqueeze(-1),
                       torch.full_like(lse, -(1 - smoothing)).unsqueeze(-1))
    return torch.where(kept.unsqueeze(-1), g, 0.0)


class _ChunkedHeadLoss(torch.autograd.Function):
    """(summed loss over the kept labels, correctness per token) of ``hidden [N, H] @ weight.T [H, V]``; the
    gradients of ``hidden`` and ``weight`` computed in forward, chunk by chunk (``chunk_pass`` each), and scaled
    in backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int,
                smoothing: float, chunk_pass: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
        w = weight.to(hidden.dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(target.shape, dtype=torch.bool, device=hidden.device)
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if grads else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            loss, right, d_hidden, d_weight = chunk_pass(hidden[rows], w, target[rows], smoothing, grads)
            total += loss
            correct[rows] = right
            if grads:
                grad_hidden[rows] = d_hidden
                grad_weight += d_weight
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(correct)
        ctx.weight_dtype = weight.dtype
        return total, correct

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_correct: Optional[torch.Tensor]):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_total.to(torch.float32)
        return ((grad_hidden * scale.to(grad_hidden.dtype)) if ctx.needs_input_grad[0] else None,
                (grad_weight * scale).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None,
                None, None, None, None)


def _chunk_losses(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, smoothing: float):
    loss, _, _, right = _chunk_terms((h @ w.T).float(), t, smoothing)
    return loss, right


def chunked_head_terms(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int,
                       smoothing: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses (0 where the label is IGNORE_INDEX) and correctness of ``hidden [..., H]`` against
    ``target [...]``: ``reduction="none"``. Evaluation's run without gradients, a chunk's logits at a time; where
    gradients are asked for (a last partial batch's masked sum) autograd keeps every chunk's logits, as unchunked."""
    return _chunk_loop(_terms, _chunk_losses, hidden, weight, target, chunk, smoothing)


def _terms(hidden, weight, target, chunk: int, smoothing: float, chunk_losses):
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    w = weight.to(hidden.dtype)
    losses, correct = [], []
    tracked = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with contextlib.nullcontext() if tracked else torch.no_grad():
        for start in range(0, flat_h.shape[0], chunk):
            loss, right = chunk_losses(flat_h[start:start + chunk], w, flat_t[start:start + chunk], smoothing)
            losses.append(loss)
            correct.append(right)
    return torch.cat(losses).view_as(target), torch.cat(correct).view_as(target)


def _chunk_loop(loop: Callable, chunk_fn: Callable, *args):
    """``loop(*args, chunk_fn)``; inside a compiled step, out of the traced graph with ``chunk_fn`` compiled alone."""
    if torch.compiler.is_compiling():
        return _outside_the_compiled_graph(loop, chunk_fn, *args)
    return loop(*args, chunk_fn)


COMPILED: Dict[Callable, Callable] = {}  # each chunk function, compiled once: its first call inside a compiled step


@torch.compiler.disable
def _outside_the_compiled_graph(loop: Callable, chunk_fn: Callable, *args):
    """``loop(*args, chunk_fn)`` inside a compiled step: the chunk loop stays out of the traced graph and
    ``chunk_fn`` is compiled on its own. Traced whole, Inductor unrolls the loop and fuses across the chunks' logits
    (several GB each at a large vocabulary), and on an H200 one such fused kernel read out of bounds (Qwen2's
    151,936 ids, 4 chunks of 4096). dynamic=False: every chunk but a last, shorter one has one shape, so one
    kernel set serves them all. The whole-step graph captures them as any."""
    if chunk_fn not in COMPILED:
        COMPILED[chunk_fn] = torch.compile(chunk_fn, dynamic=False)
    return loop(*args, COMPILED[chunk_fn])


def whole_weight(head: torch.nn.Module) -> torch.Tensor:
    """The head's weight as the loss must read it: whole. FSDP2 swaps a module's parameters for their gathered
    tensors around its unit's forward and back to shards (DTensors) after it; a shard here means the weight was
    resharded before the loss ran, which would train on a slice of the vocabulary."""
    weight = head.weight
    if is_dtensor(weight):
        raise RuntimeError("the chunked head's loss found the head's weight sharded (a DTensor): FSDP2 resharded it "
                           "after the model's forward; keep the unit that holds the head gathered until backward "
                           "(train.fsdp.root=gathered, or fully_shard(..., reshard_after_forward=False) on it)")
    return weight


def loss_positions(target: torch.Tensor, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``index [size]``, ``used [size]``): the flat positions of ``target [N]``'s labels that count, in order, in
    ``size`` slots (unused slots index position 0 and are marked unused), in fixed shapes on the device (graph-safe:
    no host sync, whatever the step's count). Labels past ``size`` find no slot: the caller checks the count."""
    kept = target != IGNORE_INDEX
    rank = torch.cumsum(kept, 0) - 1
    slot = torch.where(kept & (rank < size), rank, size)  # slot ``size``: where every other position lands
    index = torch.zeros(size + 1, dtype=torch.int64, device=target.device)
    index.scatter_(0, slot, torch.arange(target.shape[0], device=target.device))
    used = torch.arange(size, device=target.device) < kept.sum()
    return torch.where(used, index[:size], 0), used


def at_loss_positions(hidden: torch.Tensor, target: torch.Tensor, size: int):
    """(hidden states [size, H], their labels [size], ``loss_positions``' index and used, and a factor: 1, or NaN
    where the step holds more than ``size`` loss tokens): the chunked head's input at the loss tokens only. The
    packer bounds each row's loss tokens (recipe.model.head_loss_tokens_per_row), so the count fits; a step that
    did not would train on part of its loss, so the factor makes its loss and gradients NaN, which stops the run
    (trainer.NonFiniteLossError) rather than train differently."""
    index, used = loss_positions(target, size)
    overflow = (target != IGNORE_INDEX).sum() > size
    poison = torch.where(overflow, float("nan"), 1.0)
    return hidden.index_select(0, index), torch.where(used, target[index], IGNORE_INDEX), index, used, poison


def chunked_head_criterion(head: torch.nn.Linear, chunk: Optional[int], smoothing: float = 0.0,
                           loss_tokens_per_row: Optional[int] = None):
    """``Recipe.criterion`` (with its ``with_top1`` and ``top1``) over the model's hidden states, ``head`` (the
    model's ``lm_head``, bias-free) applied ``chunk`` tokens at a time; ``Recipe.correct`` is its ``top1``.

    ``loss_tokens_per_row``: training's head runs at the loss tokens only (``at_loss_positions``), a batch of
    ``rows`` holding at most ``rows * loss_tokens_per_row`` of them (the packer's bound): fewer logits by the share
    of tokens that carry no loss (a conversation's prompts). ``chunk`` None: all of them in one chunk. Evaluation
    (``reduction="none"``) runs over every token as without it."""

    def with_top1(hidden: torch.Tensor, target: torch.Tensor,
                  reduction: str = "mean") -> Tuple[torch.Tensor, torch.Tensor]:
        weight = whole_weight(head)
        flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        if reduction == "none":
            return chunked_head_terms(hidden, weight, target, chunk or flat_t.shape[0], smoothing)
        if loss_tokens_per_row is None:
            total, correct = _chunk_loop(_ChunkedHeadLoss.apply, _chunk_pass, flat_h, weight, flat_t,
                                         chunk or flat_t.shape[0], smoothing)
        else:
            size = min(flat_t.shape[0], target.shape[0] * loss_tokens_per_row)
            h, t, index, used, poison = at_loss_positions(flat_h, flat_t, size)
            total, right = _chunk_loop(_ChunkedHeadLoss.apply, _chunk_pass, h, weight, t, chunk or size, smoothing)
            total = total * poison
            # each slot's correctness back at its position; unused slots write to a slot past the end
            correct = torch.zeros(flat_t.shape[0] + 1, dtype=torch.bool, device=flat_t.device)
            correct = correct.scatter(0, torch.where(used, index, flat_t.shape[0]), right)[:-1]
        if reduction == "mean":
            total = total / (target != IGNORE_INDEX).sum()
        return total, correct.view_as(target)

    def criterion(hidden: torch.Tensor, target: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        return with_top1(hidden, target, reduction)[0]

    def top1(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each token's top-1 against its label, a chunk at a time, no gradients: a pass of the head of its own,
        which the compiled step (graph.compile_model) saves by counting it in the loss's pass (``with_top1``)."""
        with torch.no_grad():
            return chunked_head_terms(hidden, whole_weight(head), target, chunk or target.numel())[1]

    return fused_with_top1(criterion, with_top1, top1)


def pass_hidden_states_through(head: torch.nn.Module) -> None:
    """The model's ``lm_head`` returns its input: the model's ``logits`` are then its final hidden states, for the
    chunked criterion. The module keeps its weight (state dict, checkpoints, export and a tied embedding as they
    were); only its call changes."""
    head.forward = hidden_states_as_the_head_reads_them


def hidden_states_as_the_head_reads_them(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` in the dtype the head's matmul reads it in: autocast's where autocast is on (the step's forward),
    as a Linear under autocast casts its input. The loss runs outside autocast (trainer/step/steps.py), so without
    this the chunks' matmuls ran in fp32: measured on an H200 (Qwen2 0.5B, 4 x 4096 tokens, bf16), 254 ms of a
    371 ms step in fp32 GEMMs."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return hidden.to(torch.get_autocast_dtype(device))
    return hidden
