"""The doctor's report: its verdict and exit code, the table a user reads, and its JSON."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from graphing.doctor.findings import BLOCKS, WRONG, Finding

EXIT_READY, EXIT_BLOCKED, EXIT_WRONG = 0, 7, 6  # apart from the trainer's codes (trainer/run/errors.py)
VERDICT_EXIT = {"ready": EXIT_READY, "blocked": EXIT_BLOCKED, "captures-but-wrong": EXIT_WRONG}
COLUMNS = ["kind", "effect", "where", "what", "fix"]
SKIPPED_WITHOUT_CUDA = [
    "capture attempt (torch.cuda.graph)",
    "CUDA's own sync detection (torch.cuda.set_sync_debug_mode)",
    "device memory growth (torch.cuda.memory_allocated)",
    "GPU busy time per step (torch.profiler)",
]


def verdict_of(findings: Sequence[Finding]) -> str:
    if any(f.effect == BLOCKS for f in findings):
        return "blocked"
    if any(f.effect == WRONG for f in findings):
        return "captures-but-wrong"
    return "ready"


@dataclass
class DoctorReport:
    """What ``diagnose`` found; ``str(report)`` is the table a user reads."""

    findings: List[Finding]
    verdict: str  # "ready" | "blocked" | "captures-but-wrong"
    capture_error_mode: str  # the strictest mode that the step can be captured with (recommended)
    device: str
    world_size: int
    checked_steps: int
    capture: str  # what the capture attempt gave, or why there was none
    eager_step_ms: Optional[float] = None
    gpu_busy_ms: Optional[float] = None
    skipped: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return VERDICT_EXIT[self.verdict]

    @property
    def kinds(self) -> List[str]:
        return [f.kind for f in self.findings]

    def rows(self) -> List[List[Any]]:
        """One row per finding, in ``COLUMNS`` order (for W&B tables and CSV)."""
        return [[f.kind, f.effect, f.where, f.what, f.fix] for f in self.findings]

    @property
    def gpu_busy_fraction(self) -> Optional[float]:
        if self.eager_step_ms and self.gpu_busy_ms is not None:
            return self.gpu_busy_ms / self.eager_step_ms
        return None

    def gain(self) -> str:
        """The expected gain of a graph, in one line."""
        if self.eager_step_ms is None:
            return "not measured"
        eager = f"eager step {self.eager_step_ms:.2f} ms"
        if self.gpu_busy_ms is None:
            return f"{eager}; GPU busy time not measured (needs CUDA)"
        busy, fraction = self.gpu_busy_ms, self.gpu_busy_fraction
        text = f"{eager}, GPU busy {busy:.2f} ms per step ({100 * fraction:.0f}%)"
        if fraction < 0.8:
            speedup = self.eager_step_ms / max(busy, 1e-3)
            return f"{text}: launch-bound, a graph could bring the step toward {busy:.2f} ms (up to {speedup:.1f}x)"
        return f"{text}: GPU-bound, a graph saves at most {100 * (1 - fraction):.0f}% of the step"

    def table(self) -> str:
        head = (f"graph doctor: {self.checked_steps} eager steps checked on {self.device}"
                f"{f', {self.world_size} ranks' if self.world_size > 1 else ''}")
        lines = [head]
        if self.findings:
            width = [max(len(c), *(len(str(r[i])) for r in self.rows())) for i, c in enumerate(COLUMNS[:3])]
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(COLUMNS[:3], width)) + "  what -> fix")
            pad = " " * (2 + sum(width) + 2 * len(width))
            for row in self.rows():
                lines.append("  " + "  ".join(str(v).ljust(w) for v, w in zip(row[:3], width)) + "  " + row[3])
                lines.append(f"{pad}-> {row[4]}")
        else:
            lines.append("  no findings: nothing here blocks a capture or makes a captured step wrong")
        lines.append(f"verdict: {self.verdict} (exit {self.exit_code}) | recommended capture_error_mode: "
                     f"{self.capture_error_mode}")
        lines.append(f"expected gain: {self.gain()}")
        lines.append(f"capture: {self.capture}")
        if self.skipped:
            lines.append("skipped without CUDA: " + "; ".join(self.skipped))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["findings"] = [{**asdict(f), "where": f.where} for f in self.findings]
        out.update(exit_code=self.exit_code, gpu_busy_fraction=self.gpu_busy_fraction, expected_gain=self.gain())
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DoctorReport":
        names = {f for f in cls.__dataclass_fields__}
        findings = [Finding(**{k: v for k, v in f.items() if k != "where"}) for f in d["findings"]]
        return cls(**{**{k: v for k, v in d.items() if k in names}, "findings": findings})
