"""Performance numbers of a run: step times per phase, throughput, MFU, and the
same-process eager-vs-graph comparison.

Step times come from graphing's StepTimer (CUDA events, read lazily at log intervals).
Throughput counts the recipe's unit (samples, or tokens for language models), globally
and per GPU. A phase's wall window (``WallWindow``: its first step's start to its last
step's end, everything between counted) gives the throughput that benchmarks compare,
the same measure on both sides (scripts/lib/timing.py times a yardstick with it). MFU
divides achieved FLOP/s per GPU by the GPU's dense datasheet peak at the run's precision.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import torch

from graphing import StepTimer
from trainer.metrics.results import markdown_table
from trainer.run.runtime import print_once

# Dense tensor-core peaks, TFLOP/s (NVIDIA datasheets; "dense" = half the with-sparsity figure).
# Matched in order against torch.cuda.get_device_name(); the first name contained wins.
# fp32 runs are measured against the TF32 peak, the most an fp32 model can get from the
# tensor cores (cuDNN convolutions use TF32 by default; matmuls only where it is allowed).
PEAK_TFLOPS = (  # (name part, label, bf16 dense, tf32 dense)
    ("H100 PCIe", "H100 PCIe", 756.0, 378.0),
    ("H100 NVL", "H100 NVL", 835.0, 417.5),
    ("H200 NVL", "H200 NVL", 835.0, 417.5),
    ("H100", "H100 SXM", 989.0, 494.5),
    ("H200", "H200 SXM", 989.0, 494.5),
    ("A100", "A100", 312.0, 156.0),
)


def peak_tflops(device_name: str, precision: str) -> Optional[Tuple[str, float]]:
    """("<GPU> <bf16|tf32> dense", TFLOP/s) for a known GPU, else None."""
    for part, label, bf16, tf32 in PEAK_TFLOPS:
        if part.lower() in device_name.lower():
            if precision in ("bf16", "fp16"):  # the same tensor-core peak for both 16-bit formats
                return f"{label} {precision} dense", bf16
            return f"{label} tf32 dense", tf32
    return None


class WallWindow:
    """The wall time from the start of a phase's first step to the end of its last, with what the steps trained.

    Everything between counts: a metric read, a host sync, an evaluation, whatever delays the device, where step
    times (StepTimer, restarted after a read) leave it out. On CUDA the two ends are events on the device's clock
    (no host sync in the loop; read once, after the last step); off CUDA the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.first = self._marker()
        self.last = None
        self.steps, self.units = 0, 0.0

    def _marker(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ended(self, units: float) -> None:
        """Marks the end of a step that trained ``units``."""
        self.last = self._marker()
        self.steps += 1
        self.units += units

    def seconds(self) -> float:
        if self.last is None:
            return 0.0
        if self.cuda:
            self.last.synchronize()
            return self.first.elapsed_time(self.last) / 1e3
        return self.last - self.first

    def summary(self, unit: str, world_size: int) -> Dict[str, float]:
        """wall_s, wall_steps, wall_<unit>_per_s (all GPUs) and per GPU; {} before a step ended."""
        seconds = self.seconds()
        if not self.steps or seconds <= 0:
            return {}
        per_s = self.units / seconds
        return {"wall_s": seconds, "wall_steps": self.steps, f"wall_{unit}_per_s": per_s,
                f"wall_{unit}_per_s_per_gpu": per_s / world_size}


class Perf:
    """Times every step by phase and turns the times into throughput and MFU."""

    def __init__(self, device: torch.device, *, units_per_step: float, unit: str, world_size: int,
                 flops_per_unit: float, precision: str, units_per_sample: float = 1.0,
                 padding_fraction: Optional[float] = None):
        self.device, self.unit, self.world_size = device, unit, world_size
        # packed rows: the share of their tokens that is padding; perf/real_<unit>_per_s counts the others only
        self.padding_fraction = padding_fraction
        self.units_per_step = units_per_step  # global: samples (or tokens) per optimizer step, all ranks
        self.flops_per_unit, self.precision = flops_per_unit, precision
        self.timer = StepTimer(device)
        self.units_per_sample = units_per_sample  # 1, or the tokens of a sequence
        self.window_units = 0.0  # units trained by the steps timed since the last window()
        self.shapes: Dict[str, Any] = {}  # timed phase name -> the shape its steps have
        self.walls: Dict[str, WallWindow] = {}  # phase (its tail and bucket steps included) -> its wall window

    def begin(self, phase: str) -> None:
        """Marks the start of a step of ``phase`` (before its work is queued): the first opens its wall window."""
        if phase not in self.walls:
            self.walls[phase] = WallWindow(self.device)

    def step(self, phase: str, shape=None) -> None:
        """Marks the end of a step of ``phase`` ("graph", or "graph@tail48" for a step of another shape),
        training what ``shape`` holds (None: a full step)."""
        self.timer.step(phase)
        units = self.units_of(shape)
        self.window_units += units
        wall = self.walls.get(phase.split("@")[0])  # a tail's or bucket's step lies inside its phase's window
        if wall is not None:
            wall.ended(units)
        if shape is not None:
            self.shapes.setdefault(phase, shape)

    def units_of(self, shape) -> float:
        """Units one step of ``shape`` trains, all ranks: a tail its real samples, a
        sequence-length bucket its tokens."""
        if shape is None:
            return self.units_per_step
        samples = shape.real if shape.tail else self.units_per_step / self.units_per_sample
        return samples * (shape.seq_len or self.units_per_sample)

    def window(self) -> Dict[str, float]:
        """Mean step time and throughput of the steps timed since the last call (collects events)."""
        self.timer.collect()
        steps, total_ms = self.timer.take_window()
        units, self.window_units = self.window_units, 0.0
        if not steps:
            return {}
        return self.with_real({"perf/step_ms": total_ms / steps, f"perf/{self.unit}_per_s": units * 1e3 / total_ms})

    def with_real(self, values: Dict[str, Any]) -> Dict[str, Any]:
        """``values`` and, for packed rows, each ``*<unit>_per_s`` as ``*real_<unit>_per_s`` too: the tokens that
        are not padding (the epoch's packing's share, which every epoch's rows hold in total)."""
        if self.padding_fraction is None:
            return values
        per_s = f"{self.unit}_per_s"
        real = {k.replace(per_s, f"real_{per_s}"): v * (1.0 - self.padding_fraction)
                for k, v in values.items() if k.endswith((per_s, f"{per_s}_per_gpu"))}
        return {**values, **real}

    def peak(self) -> Optional[Tuple[str, float]]:
        """(name, dense TFLOP/s) of this GPU at the run's precision; None off CUDA or for an unlisted GPU."""
        if self.device.type != "cuda":
            return None
        return peak_tflops(torch.cuda.get_device_name(self.device), self.precision)

    def phase_summary(self, phase: str, units_per_step: Optional[float] = None) -> Dict[str, float]:
        """Step time median/p90/mean, throughput (global and per GPU) and MFU of one phase
        (``units_per_step``: what one of its steps trains, when not a full step)."""
        self.timer.collect()
        s = self.timer.summary(phase)
        if not s:
            return {}
        per_s = f"{self.unit}_per_s"
        s[per_s] = (units_per_step or self.units_per_step) * 1e3 / s["step_ms_mean"]
        s[f"{per_s}_per_gpu"] = s[per_s] / self.world_size
        mfu = self.mfu_pct(s[f"{per_s}_per_gpu"])
        if mfu is not None:
            s["mfu_pct"] = mfu
        if phase in self.walls and units_per_step is None:  # a bucket's steps are not a window of their own
            s.update(self.walls[phase].summary(self.unit, self.world_size))
            wall_mfu = self.mfu_pct(s.get(f"wall_{per_s}_per_gpu", 0.0))
            if wall_mfu is not None and f"wall_{per_s}" in s:
                s["wall_mfu_pct"] = wall_mfu
        return s

    def mfu_pct(self, units_per_s_per_gpu: float) -> Optional[float]:
        """Model FLOPs utilization of one GPU training ``units_per_s_per_gpu`` (None: no peak or no FLOP count).
        Per GPU: a rank's share of the global throughput against one GPU's peak."""
        peak = self.peak()
        if peak is None or self.flops_per_unit <= 0:
            return None
        return 100 * units_per_s_per_gpu * self.flops_per_unit / (peak[1] * 1e12)

    def run_summary(self, headline_phase: str) -> Dict[str, Any]:
        """``perf/*`` for the results: the headline phase's numbers, the MFU peak used, memory."""
        out: Dict[str, Any] = {f"perf/{k}": v for k, v in self.phase_summary(headline_phase).items()}
        for name, shape in self.shapes.items():  # sequence-length buckets, each timed apart
            if name.startswith(f"{headline_phase}@") and shape.seq_len is not None and not shape.tail:
                bucket = self.phase_summary(name, self.units_of(shape))
                for key in ("step_ms_median", f"{self.unit}_per_s", "steps_timed"):
                    out[f"perf/bucket_T{shape.seq_len}/{key}"] = bucket[key]
        peak = self.peak()
        if peak is not None and self.flops_per_unit > 0:
            out["perf/mfu_peak"], out["perf/mfu_peak_tflops"] = peak
            out["perf/flops_per_unit"] = self.flops_per_unit
        out = self.with_real(out)
        out["perf/peak_host_mib"] = peak_host_mib()  # this rank's process: a model loaded on the host shows here
        if self.device.type == "cuda":
            out["perf/peak_allocated_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            out["perf/peak_reserved_mib"] = torch.cuda.max_memory_reserved(self.device) / 2**20
        return out

    def comparison(self, logger=None) -> Dict[str, Any]:
        """Eager vs graph steps of this process (same data, same model state): prints, logs, returns."""
        eager, graph = self.phase_summary("eager"), self.phase_summary("graph")
        if not eager or not graph:
            return {}
        speedup = eager["step_ms_mean"] / graph["step_ms_mean"]
        result = {**{f"eager/{k}": v for k, v in eager.items()}, **{f"graph/{k}": v for k, v in graph.items()},
                  "speedup": speedup}
        per_s = f"{self.unit}_per_s"
        rows = [[name, side[per_s], side["step_ms_median"], side["step_ms_p90"], side["steps_timed"]]
                for name, side in (("eager", eager), ("graph", graph))]
        print_once(markdown_table(["mode", per_s, "step ms median", "step ms p90", "steps"], rows)
                   + f"\nspeedup (graph vs eager, same process, same data): {speedup:.2f}x")
        if logger is not None:
            logger.summary(result)
            logger.table("comparison", ["mode", per_s, "step_ms_median", "step_ms_p90", "steps"], rows,
                         bar=("mode", per_s))
        return result


def peak_host_mib() -> float:
    """This process's peak resident host memory so far, in MiB (Linux reports KiB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)
