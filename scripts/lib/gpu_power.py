"""The GPU's power draw and SM clock while a script's timed steps run (nvidia-smi, sampled every 100 ms).

Where a step keeps the GPU busy, an H200 runs at its power limit (700 W) and lowers its clock to stay there:
the step then takes its energy over the limit, and a step with idle gaps (an eager loop's launches) gets a
higher clock for its kernels than the same kernels back to back in a graph (RESULTS.md, "GPT-2 small:
alternating pairs"). Two steps are then told apart by their energy, not their kernel list alone:

    with sampler(args.power, device_index) as power:
        start = time.monotonic()
        ... the timed steps, synchronized at the end ...
        end = time.monotonic()
    result["power"] = power.window(start, end, step_ms)   # None when off; {"samples": n, "why": ...} when too few

A machine without nvidia-smi (or a GPU it cannot query) gives ``{"samples": 0, "why": ...}``: the script's other
numbers are unaffected. Sampling is asked for (the scripts' ``--power``), never on by default: a run timed against
another one carries it only where both do.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

FIELDS = ("power.draw", "power.limit", "clocks.sm", "temperature.gpu", "clocks_event_reasons.active")
SW_POWER_CAP = 0x4  # nvidia-smi's clocks_event_reasons bit: clocks lowered to hold the power limit
MIN_SAMPLES = 5


def device_selector(device_index: int) -> str:
    """The ``nvidia-smi -i`` argument for torch's CUDA device ``device_index`` (its UUID: CUDA_VISIBLE_DEVICES
    renumbers devices, nvidia-smi does not)."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def parse_line(line: str) -> Optional[Dict[str, float]]:
    """One line of ``--format=csv,noheader,nounits`` for FIELDS: {field: value}, a field nvidia-smi cannot read
    ("[N/A]", "Not Supported") left out; None for a line that is not one of ours."""
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != len(FIELDS):
        return None
    sample: Dict[str, float] = {}
    for name, cell in zip(FIELDS, cells):
        value = cell.split()[0] if cell else ""  # "692.86 W" where units were left on
        try:
            sample[name] = float(int(value, 16)) if value.startswith("0x") else float(value)
        except ValueError:
            continue
    return sample


def sampler(enabled: bool, device_index: int) -> "PowerSampler":
    """A PowerSampler of torch's CUDA device ``device_index`` where ``enabled``, else one that samples nothing."""
    return PowerSampler(device_selector(device_index) if enabled else None)


class PowerSampler:
    """nvidia-smi in the background, one sample of FIELDS every ``interval_ms``, each stamped with
    time.monotonic() as it arrives. ``selector``: nvidia-smi's ``-i`` (``device_selector``); None: off (no
    process; ``window`` gives None)."""

    def __init__(self, selector: Optional[str], interval_ms: int = 100, executable: str = "nvidia-smi"):
        self.selector, self.interval_ms, self.executable = selector, interval_ms, executable
        self.samples: List[Tuple[float, Dict[str, float]]] = []
        self.why: Optional[str] = None
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None

    def __enter__(self) -> "PowerSampler":
        if self.selector is None:
            return self
        path = shutil.which(self.executable)
        if path is None:
            self.why = f"no {self.executable} on PATH"
            return self
        command = [path, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                   f"--loop-ms={self.interval_ms}", f"--id={self.selector}"]
        try:
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          bufsize=1)
        except OSError as e:  # found but not runnable here
            self.why = f"{self.executable} did not start: {e}"
            return self
        self._reader = threading.Thread(target=self._read, name="gpu-power", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_line(line)
            if sample is not None:
                self.samples.append((time.monotonic(), sample))
            elif self.why is None and line.strip():
                self.why = f"{self.executable} said: {line.strip()[:200]}"

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def window(self, start: float, end: float, step_ms: float) -> Optional[Dict[str, Any]]:
        """What the samples between ``start`` and ``end`` (time.monotonic()) say: the median power (W) and SM
        clock (MHz), the power limit, the hottest temperature, the fraction of samples whose clocks were lowered
        to hold the power limit, and ``joules_per_step``: the median power times ``step_ms``. Fewer than
        MIN_SAMPLES: only ``samples`` and ``why``. None where sampling was off."""
        if self.selector is None:
            return None
        inside = [s for t, s in self.samples if start <= t <= end]
        if len(inside) < MIN_SAMPLES:
            why = self.why or (f"{len(inside)} samples in {end - start:.2f} s, fewer than {MIN_SAMPLES}: time "
                               f"more steps")
            return {"samples": len(inside), "why": why}

        def median(field: str) -> Optional[float]:
            values = [s[field] for s in inside if field in s]
            return statistics.median(values) if values else None

        power = median("power.draw")
        reasons = [int(s["clocks_event_reasons.active"]) for s in inside if "clocks_event_reasons.active" in s]
        temperatures = [s["temperature.gpu"] for s in inside if "temperature.gpu" in s]
        return {"samples": len(inside), "power_w": power, "power_limit_w": median("power.limit"),
                "sm_clock_mhz": median("clocks.sm"),
                "power_capped_fraction": (sum(1 for r in reasons if r & SW_POWER_CAP) / len(reasons)
                                          if reasons else None),
                "temperature_max_c": max(temperatures) if temperatures else None,
                "joules_per_step": power * step_ms / 1e3 if power is not None else None}


def describe(power: Optional[Dict[str, Any]]) -> str:
    """One line for a script's output."""
    if not power:
        return "power: not sampled"
    if "power_w" not in power:
        return f"power: not measured ({power.get('why')})"
    def shown(key: str, form: str) -> str:  # a field nvidia-smi could not read: "?"
        return "?" if power.get(key) is None else form.format(power[key])

    capped = power.get("power_capped_fraction")
    return (f"power: {shown('power_w', '{:.0f}')} W of {shown('power_limit_w', '{:.0f}')}, "
            f"SM {shown('sm_clock_mhz', '{:.0f}')} MHz, {shown('joules_per_step', '{:.2f}')} J a step"
            + (f", power-capped in {100 * capped:.0f}% of {power['samples']} samples" if capped is not None else ""))
