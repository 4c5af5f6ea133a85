"""The doctor's checks over one eager step, for a capture that failed: which line of the user's
code broke it. Run on every rank (the step's collectives must match) once the run is stopping."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from graphing.doctor.eager_checks import EagerChecks
from graphing.doctor.findings import BLOCKS, Finding, in_report_order
from graphing.doctor.ranks import gather_findings
from graphing.doctor.step_runner import on_side_stream
from graphing.executor import distributed


def blocking_findings(fn: Callable[[], None], model: torch.nn.Module, device: torch.device,
                      stream: Optional["torch.cuda.Stream"] = None,
                      optimizers: Sequence[torch.optim.Optimizer] = ()) -> List[Finding]:
    """Runs ``fn`` once eagerly (on ``stream``) with the doctor's checks on; what would block a capture."""
    checks = EagerChecks(model, device, optimizers)
    checks.start()
    try:
        checks.begin_step(0, ())
        with checks.watching(cuda_syncs=torch.device(device).type == "cuda"):
            on_side_stream(fn, stream)
    except Exception:  # the step may fail after the capture that failed: what was found so far still counts
        pass
    finally:
        checks.end_step()
        checks.stop()
    return [f for f in in_report_order(checks.findings) if f.effect == BLOCKS]


def describe(findings: Sequence[Finding]) -> List[str]:
    """One line per finding (kind, file:line, what was seen, the fix), gathered from every rank when
    distributed (a collective): a finding not every rank saw names its ranks."""
    world = 1
    if distributed():
        findings, world = gather_findings(list(findings)), dist.get_world_size()
    return [f"{f.kind} at {f.where}: {f.what}. Fix: {f.fix}"
            + (f" (rank {', '.join(map(str, f.ranks))})" if world > 1 and len(f.ranks) < world else "")
            for f in findings]
