"""Under a process group every rank checks its own step; all ranks get one merged report."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from graphing.doctor.findings import Finding, in_report_order
from graphing.doctor.report import DoctorReport, verdict_of
from graphing.executor import distributed
from graphing.options import CaptureErrorMode

_STRICT_FIRST = [m.value for m in CaptureErrorMode]  # global, thread_local, relaxed


def laxest(modes: Iterable[str]) -> str:
    return max(modes, key=_STRICT_FIRST.index)


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True on every rank iff ``flag`` is true on every rank (a collective under a process group)."""
    if not distributed():
        return flag
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    votes = torch.tensor([0 if flag else 1], device=on)
    dist.all_reduce(votes)
    return int(votes.item()) == 0


def merge_findings(per_rank: Iterable[Iterable[Finding]]) -> List[Finding]:
    """Each (kind, file, line) once, with the union of the ranks that saw it, in report order."""
    merged: Dict[Tuple[str, str, int], Finding] = {}
    for findings in per_rank:
        for f in findings:
            if f.key in merged:
                merged[f.key].ranks = sorted(set(merged[f.key].ranks) | set(f.ranks))
            else:
                merged[f.key] = f
    return in_report_order(merged.values())


def gather_findings(findings: List[Finding]) -> List[Finding]:
    """Every rank's findings (each marked with its rank), merged, on every rank (a collective)."""
    rank = dist.get_rank()
    for f in findings:
        f.ranks = [rank]
    gathered: List[Optional[List[Finding]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, findings)
    return merge_findings(seen or [] for seen in gathered)


def merge_ranks(report: DoctorReport) -> DoctorReport:
    """Every rank's report merged into one, on every rank (a collective: all ranks call it)."""
    gathered: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report.to_dict())
    reports = [DoctorReport.from_dict(d) for d in gathered]
    findings = merge_findings(r.findings for r in reports)
    first = reports[0]
    failed = next((r.capture for r in reports if r.capture.startswith("failed")), first.capture)
    eager = [r.eager_step_ms for r in reports if r.eager_step_ms is not None]
    notes = list(dict.fromkeys(n for r in reports for n in r.notes))
    return DoctorReport(findings, verdict_of(findings), laxest([r.capture_error_mode for r in reports]), first.device,
                        first.world_size, first.checked_steps, failed, max(eager) if eager else None,
                        first.gpu_busy_ms, first.skipped, notes)
