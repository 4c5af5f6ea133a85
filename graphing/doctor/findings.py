"""What the doctor reports: a finding (its kind, effect, place, what was seen, the fix), and the
findings of one diagnosis, which every check adds to."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

BLOCKS, WRONG = "blocks", "wrong"  # capture fails / captures, then replays a frozen or wrong step

FIXES: Dict[str, str] = {
    "host_sync": "Keep the value on the device inside the step (accumulate it in a device tensor) and read "
                 "it outside the step, at a log interval.",
    "host_to_device_copy": "Make the tensor once, outside the step, as a device buffer that you update in place "
                           "(or use the Python number directly as an operand, e.g. `loss * 0.5`).",
    "shape_change": "Bring the inputs to a few shapes: GraphedStep (and graph.mode=full) capture one graph per "
                    "shape, up to max_graphs (graph.max_graphs), all in one memory pool. Pad varying sizes up to "
                    "a few buckets (sequence lengths rounded up to a multiple), or raise max_graphs.",
    "control_flow": "Make every step take the same path: select with tensors (torch.where, a 0/1 weight) "
                    "instead of a Python `if` on state that changes between steps.",
    "python_scalar": "Keep a value that changes between steps in a device tensor updated in place: the graph "
                     "keeps the Python number it saw at capture.",
    "lr_frozen": "Set the lr in your loop before each call (GraphedStep carries it into the graph), or write it "
                 "into a device tensor lr in place (group['lr'].fill_(value), a device-side schedule such as "
                 "trainer/schedules.py).",
    "optimizer": "Build the optimizer with capturable=True, or hand it to GraphedStep before its first step (it "
                 "turns capturable on); graphing.graph_safe_optimizer_kwargs "
                 "gives the arguments.",
    "grad_scaler": "Train in bf16 without a GradScaler, or give the scaler a fused optimizer (fused=True), "
                   "which checks for infs on the device.",
    "autocast_cache": "Enter autocast inside the step (or pass cache_enabled=False), so that no weight cast "
                      "cached before the step is read by the graph.",
    "ddp_find_unused_parameters": "Build DDP with find_unused_parameters=False and let every parameter reach "
                                  "the loss (or set requires_grad=False on the ones that never do).",
    "sync_batchnorm": "Use BatchNorm (or GroupNorm) in the graphed step: this torch's SyncBatchNorm syncs with "
                      "the host while capturing.",
    "unregistered_generator": "Draw from the default generator (seeded by torch.manual_seed), which every replay "
                              "advances; a generator of your own must be registered with the graph "
                              "(CUDAGraph.register_generator_state).",
    "memory_growth": "Do not keep a tensor per step in Python (a list of losses, a history): add into a "
                     "preallocated device tensor instead, which replays keep updating.",
    "capture_failed": "Fix the call named here (the message says why), or keep this step eager.",
}


@dataclass
class Finding:
    """One problem, at the place in the user's code (or recipe, or trainer/) that causes it."""

    kind: str
    effect: str  # BLOCKS: capture fails; WRONG: it captures, and replays a frozen or wrong step
    file: str = ""  # absolute path; "" when no single line is to blame
    line: int = 0
    what: str = ""  # what was seen, in a phrase
    fix: str = ""  # the fix, in one sentence
    step: Optional[int] = None  # the first eager step (0-based) where it was seen
    ranks: List[int] = field(default_factory=list)

    @property
    def where(self) -> str:
        if not self.file:
            return "-"
        path = self.file
        try:
            rel = os.path.relpath(path)
            if not rel.startswith(".."):
                path = rel
        except ValueError:  # another drive
            pass
        return f"{path}:{self.line}"

    @property
    def key(self) -> Tuple[str, str, int]:
        return (self.kind, self.file, self.line)


def in_report_order(findings: Iterable[Finding]) -> List[Finding]:
    """What blocks a capture first (a user meets it first), then by step and place."""
    return sorted(findings, key=lambda f: (f.effect != BLOCKS, f.step or 0, f.file, f.line))


def place_of(frame) -> Tuple[str, int]:
    """(absolute file, line) of a frame; ("", 0) for none."""
    if frame is None:
        return "", 0
    return os.path.abspath(frame.f_code.co_filename), frame.f_lineno


class Findings:
    """The findings of one diagnosis, one per (kind, file, line): the first seen stays.

    ``step`` is the eager step being run or compared (-1: none); a finding added meanwhile is dated
    with it.
    """

    def __init__(self):
        self.step = -1
        self._by_key: Dict[Tuple[str, str, int], Finding] = {}

    def add(self, kind: str, effect: str, file: str = "", line: int = 0, what: str = "", fix: str = "") -> None:
        key = (kind, file, line)
        if key not in self._by_key:
            self._by_key[key] = Finding(kind, effect, file, line, what, fix or FIXES[kind],
                                        self.step if self.step >= 0 else None)

    def add_at_frame(self, kind: str, effect: str, frame, what: str, fix: str = "") -> None:
        self.add(kind, effect, *place_of(frame), what, fix)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self._by_key.values())

    def kinds(self) -> Set[str]:
        return {f.kind for f in self}

    def places(self) -> Set[Tuple[str, int]]:
        return {(f.file, f.line) for f in self}

    def any_blocking(self) -> bool:
        return any(f.effect == BLOCKS for f in self)
