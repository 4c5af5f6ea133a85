"""What the doctor reports: a finding (its kind, effect, place, what was seen, the fix), and the
findings of one diagnosis, which every check adds to."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

from graphing.doctor.attribution import Site, short_path
from graphing.float8_scales import STALE_SCALES_FIX

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
                 "trainer/step/schedules.py).",
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
    "float8_scales": STALE_SCALES_FIX,
}
# What the trial capture can show never to happen while capturing (a library that checks
# torch.cuda.is_current_stream_capturing() and skips it): judged against it (capture_judgement.py).
SYNC_KINDS = ("host_sync", "host_to_device_copy")
_STEP_KINDS = ("shape_change", "control_flow", "python_scalar")  # what differs between steps (step_diff.py)


def library_fix(kind: str, package: str, trial: str = "") -> str:
    """The fix for a finding inside an installed package, whose line the user cannot edit.

    ``trial``: what the doctor's trial capture showed: "" none was made (no CUDA), "made" it made the call
    too, "failed" it failed before or at the call."""
    if kind not in SYNC_KINDS:
        return (f"The call is made inside {package}, which your line calls: pass it the same shapes, flags and "
                f"Python numbers in every step (a changing one decides its path or sizes), or look for a setting of "
                f"{package} that fixes them; otherwise keep this step eager.")
    settings = (f"look for a setting of {package} that avoids the call (what it documents for torch.compile or "
                "CUDA graphs: fixed shapes, a static cache, no mask to inspect), or keep this step eager")
    if trial:
        shown = "made it too" if trial == "made" else "failed"
        return f"The call is made inside {package}, which your line calls, and the trial capture {shown}: {settings}."
    return (f"The call is made inside {package}, which your line calls: run the doctor on CUDA, whose trial capture "
            f"shows whether {package} skips it while capturing (then nothing needs changing); if it does not, "
            f"{settings}.")


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
    # The line inside an installed package (a model library) where the call was made, when the user's
    # line called into one: absolute path, and the line.
    library_file: str = ""
    library_line: int = 0

    @property
    def where(self) -> str:
        """``user.py:12``, or ``user.py:12 -> package/module.py:34`` for a call made inside a package."""
        places = []
        if self.file:
            path = self.file
            try:
                rel = os.path.relpath(path)
                if not rel.startswith(".."):
                    path = rel
            except ValueError:  # another drive
                pass
            places.append(f"{path}:{self.line}")
        if self.library_file:
            places.append(f"{short_path(self.library_file)}:{self.library_line}")
        return " -> ".join(places) or "-"

    @property
    def key(self) -> Tuple[str, str, int, str, int]:
        return (self.kind, self.file, self.line, self.library_file, self.library_line)


def in_report_order(findings: Iterable[Finding]) -> List[Finding]:
    """What blocks a capture first (a user meets it first), then by step and place."""
    return sorted(findings, key=lambda f: (f.effect != BLOCKS, f.step or 0, f.file, f.line, f.library_file,
                                           f.library_line))


def place_of(frame) -> Tuple[str, int]:
    """(absolute file, line) of a frame; ("", 0) for none."""
    if frame is None:
        return "", 0
    return os.path.abspath(frame.f_code.co_filename), frame.f_lineno


def package_name(path: str) -> str:
    """The import name of the package a file belongs to (``transformers``)."""
    return short_path(path).replace(os.sep, "/").split("/")[0].removesuffix(".py")


class Findings:
    """The findings of one diagnosis, one per (kind, file, line): the first seen stays.

    ``step`` is the eager step being run or compared (-1: none); a finding added meanwhile is dated
    with it.
    """

    def __init__(self):
        self.step = -1
        self._by_key: Dict[Tuple[str, str, int, str, int], Finding] = {}
        self.seen_by_cuda: Set[Tuple[str, str, int, str, int]] = set()  # found by CUDA's sync detection

    def add(self, kind: str, effect: str, file: str = "", line: int = 0, what: str = "", fix: str = "",
            library: Tuple[str, int] = ("", 0)) -> Optional[Finding]:
        """Adds a finding unless one of that kind is at that place already; returns the new one, else None."""
        key = (kind, file, line, *library)
        if key in self._by_key:
            return None
        if library[0] and kind in SYNC_KINDS + _STEP_KINDS:
            fix = library_fix(kind, package_name(library[0]))
        self._by_key[key] = Finding(kind, effect, file, line, what, fix or FIXES[kind],
                                    self.step if self.step >= 0 else None, library_file=library[0],
                                    library_line=library[1])
        return self._by_key[key]

    def add_at_frame(self, kind: str, effect: str, frame, what: str, fix: str = "") -> None:
        self.add(kind, effect, *place_of(frame), what, fix)

    def add_at_site(self, kind: str, effect: str, site: Site, what: str, fix: str = "") -> Optional[Finding]:
        """At the user's line of ``site``, and the package's line when the call was made inside one."""
        return self.add(kind, effect, *place_of(site.user), what, fix, place_of(site.library))

    def __iter__(self) -> Iterator[Finding]:
        return iter(self._by_key.values())

    def kinds(self) -> Set[str]:
        return {f.kind for f in self}

    def places(self) -> Set[Tuple[str, int]]:
        return {(f.file, f.line) for f in self}

    def sites(self) -> Set[Tuple[str, int, str, int]]:
        """(user file, line, package file, line) of every finding."""
        return {f.key[1:] for f in self}

    def any_blocking(self) -> bool:
        return any(f.effect == BLOCKS for f in self)
