"""Eager steps judged by what the capture runs. A model library may skip host-side work while a
CUDA stream is capturing (transformers checks ``torch.cuda.is_current_stream_capturing()`` and
skips its mask shortcuts and packed-sequence checks), so its eager steps make host syncs and
copies that the graph never makes.

A host sync or host-to-device copy seen in the eager steps is a blocker only if the trial capture
(capture_attempt.py) makes it too. It is "eager only; not in the graph" when the trial capture of
the whole step succeeded and

- the doctor's call checks, on during the capture, saw no such call at that place (the user's
  line and the library's line): the captured step never made it, so the graph does not hold it; or
- CUDA's own sync detection found it (no Python call named it): a capture that succeeds in the
  "global" or "thread_local" mode made no host sync on its thread, since CUDA refuses one there.

A call the capture did make and still captured (it synced nothing: an asynchronous copy, say) is
no blocker either when the replays equal eager steps: the capture held and its graph does what the
eager step does. Other findings stand as they are: the capture of one step cannot show what
GraphedStep refuses before capturing (an lr written inside the step, an optimizer it cannot make
capturable, more input shapes than graphs) nor what changes between steps.
"""
from __future__ import annotations

from typing import List, Set, Tuple

from graphing.doctor.capture_attempt import TrialCapture
from graphing.doctor.findings import SYNC_KINDS, Finding, library_fix, package_name


def judge(findings: List[Finding], trial: TrialCapture, seen_by_cuda: Set[Tuple]) -> Tuple[List[Finding], List[str]]:
    """(the findings that stand, a note for each one the capture showed not to be in the graph)."""
    ran = {f.key for f in trial.seen}
    replays_equal = trial.replays is not None and trial.replays.equal
    kept, notes = [], []
    for f in findings:
        if f.kind not in SYNC_KINDS:
            kept.append(f)
        elif trial.captured and (f.key in seen_by_cuda or f.key not in ran):
            notes.append(f"eager only; not in the graph: {f.kind} at {f.where} ({f.what}): the trial capture ran "
                         f"the step without it{_who(f)}; nothing needs changing")
        elif trial.captured and replays_equal:
            notes.append(f"{f.kind} at {f.where} ({f.what}): the trial capture ran it without a host sync and its "
                         "replays equal eager steps; nothing needs changing")
        else:
            if f.library_file:  # the user can act only through the library's settings
                f.fix = library_fix(f.kind, package_name(f.library_file), "made" if f.key in ran else "failed")
            kept.append(f)
    return kept, notes


def _who(f: Finding) -> str:
    return f" ({package_name(f.library_file)} skips it while a CUDA stream is capturing)" if f.library_file else ""
