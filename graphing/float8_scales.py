"""float8 weight scales that a step sets itself, watched around a capture.

Under FSDP2's float8 all-gather, torchao casts each weight to float8 before gathering it, with a
scale it can precompute for every weight in one all-reduce
(``torchao.float8.precompute_float8_dynamic_scale_for_fsdp``). That call assigns a new scale
tensor to each weight (its ``_precomputed_scale``) rather than writing into the old one. Inside a
captured step the order decides what replays read:

- called before the forward (at the start of the step): the forward reads the tensors the same
  step wrote, and every replay writes them again. Correct.
- called after the forward (after the optimizer step, torchtitan's place for it): the captured
  forward reads the tensors the last eager step assigned, which no replay writes again; the new
  ones written at the end of each replay are read by nobody. Every replay trains with the
  warm-up's scales, silently. ``ScaleWatch`` finds this order during the capture and the executor
  refuses the graph, naming the call.

Asked of any model (no torchao import): a weight's scale is the ``_precomputed_scale`` attribute of
its local tensor (a DTensor's shard under FSDP2).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from graphing.sharded import is_dtensor, local_tensor

SCALE = "_precomputed_scale"  # torchao's attribute on a weight's float8-all-gather wrapper (fsdp_utils)

# Said once, for the executor's refusal (graphing/full.py) and the doctor's finding and fix (graphing/doctor/).
STALE_SCALES_WHAT = (
    "the step sets new float8 weight scales after its forward began: torchao's "
    "precompute_float8_dynamic_scale_for_fsdp (or code like it) runs after the model's forward, e.g. after the "
    "optimizer step (torchtitan's place for it). It assigns a new scale tensor to each weight, so a captured forward "
    "would read the scales the last eager step left on every replay, and train with them silently, while each "
    "replay's new ones go unread")
STALE_SCALES_FIX = (
    "Call torchao's precompute_float8_dynamic_scale_for_fsdp at the start of the step, before the forward (each "
    "replay then computes the scales its own forward reads), or not at all (each float8 all-gather then finds its "
    "weight's scale itself).")
STALE_SCALES = f"{STALE_SCALES_WHAT}. {STALE_SCALES_FIX}"


def scale_holders(model: torch.nn.Module) -> List[Tuple[str, object]]:
    """``(name, holder)`` of each weight whose local tensor carries a precomputable float8 scale."""
    found = []
    for name, p in model.named_parameters():
        if is_dtensor(p) and hasattr(local_tensor(p), SCALE):  # torchao precomputes for FSDP2's shards only
            found.append((name, local_tensor(p)))
    return found


class ScaleWatch:
    """Around one capture: which scale tensors the step's first forward read, which ones the step left
    assigned, and putting the ones from before back (a refused or failed capture leaves scales that
    were never computed). Inert for a model without precomputable scales."""

    def __init__(self, model: Optional[torch.nn.Module]):
        self.model = model
        self.holders = scale_holders(model) if model is not None else []
        self.before: List[object] = []
        self.at_forward: Optional[List[int]] = None
        self._hook = None

    def _ids(self) -> List[int]:
        return [id(getattr(holder, SCALE)) for _, holder in self.holders]

    def __enter__(self) -> "ScaleWatch":
        if self.holders:
            self.before = [getattr(holder, SCALE) for _, holder in self.holders]
            self._hook = self.model.register_forward_pre_hook(self._at_forward, prepend=True)
        return self

    def _at_forward(self, _module, _args) -> None:
        if self.at_forward is None:
            self.at_forward = self._ids()

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.remove()

    @property
    def stale(self) -> bool:
        """Whether the step assigned scales after its forward began (which its forward then never reads)."""
        return bool(self.holders) and self.at_forward is not None and self.at_forward != self._ids()

    def put_back(self) -> None:
        """The scales from before the capture, for the eager steps that follow a capture that did not hold."""
        for (_, holder), scale in zip(self.holders, self.before):
            setattr(holder, SCALE, scale)
