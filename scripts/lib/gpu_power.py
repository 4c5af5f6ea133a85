"""The GPU's energy, power, SM clock and temperature while a script's timed steps run (NVML, read every 100 ms).

Where a step keeps the GPU busy, an H200 runs at its power limit (700 W) and lowers its clock to stay there:
the step then takes its energy over the limit, and a step with idle gaps (an eager loop's launches) gets a
higher clock for its kernels than the same kernels back to back in a graph (RESULTS.md, "GPT-2 small:
alternating pairs"). Two steps are then told apart by their energy, not their kernel list alone:

    with sampler(args.power, device_index) as power:
        start = time.monotonic()
        ... the timed steps, synchronized at the end ...
        end = time.monotonic()
    result["power"] = power.window(start, end, step_ms)   # None when off; {"samples": n, "why": ...} when too few

The energy is NVML's own counter (``nvmlDeviceGetTotalEnergyConsumption``: millijoules since the driver loaded,
Volta and newer): the joules between the first and the last reading inside the window are counted by the GPU,
not sampled, and ``power_w`` is those joules over those seconds. A GPU without the counter gives the median of
the sampled power draw instead (``energy_from`` says which).

NVML is read through NVIDIA's Python binding, the ``pynvml`` module of the nvidia-ml-py package (torch's
``torch.cuda.power_draw`` reads it too; torch's wheels do not bring it): ``pip install nvidia-ml-py``. Without it,
without an NVIDIA driver, or for a GPU NVML cannot find, the window is ``{"samples": 0, "why": ...}`` saying
which: the script's other numbers are unaffected. Sampling is asked for (the scripts' ``--power``), never on by
default: a run timed against another one carries it only where both do.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

SW_POWER_CAP = 0x4  # NVML's clocks event reason nvmlClocksEventReasonSwPowerCap: clocks lowered to hold the limit
MIN_SAMPLES = 5
INSTALL = "pip install nvidia-ml-py"


def device_uuid(device_index: int) -> str:
    """NVML's name for torch's CUDA device ``device_index``: its UUID (CUDA_VISIBLE_DEVICES renumbers devices,
    NVML does not)."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def sampler(enabled: bool, device_index: int) -> "PowerSampler":
    """A PowerSampler of torch's CUDA device ``device_index`` where ``enabled``, else one that samples nothing."""
    return PowerSampler(device_uuid(device_index) if enabled else None)


def readings(nvml, handle) -> Dict[str, Callable[[], float]]:
    """What one sample reads, by name, in the units it is kept in."""
    reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
               or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)  # the name before nvidia-ml-py 12.535
    return {"energy_mj": lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle),
            "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,  # NVML counts milliwatts
            "power_limit_w": lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3,
            "sm_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "temperature_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "clock_event_reasons": lambda: reasons(handle)}


class PowerSampler:
    """NVML read in a background thread, one sample of ``readings`` every ``interval_ms``, each stamped with
    time.monotonic() as it is taken (a value NVML cannot read on this GPU is left out of it). ``uuid``: the
    GPU's (``device_uuid``); None: off (no thread; ``window`` gives None)."""

    def __init__(self, uuid: Optional[str], interval_ms: int = 100):
        self.uuid, self.interval_ms = uuid, interval_ms
        self.samples: List[Tuple[float, Dict[str, float]]] = []
        self.why: Optional[str] = None
        self.unread: Dict[str, str] = {}  # what NVML cannot read on this GPU, and what it said
        self._nvml = None
        self._stop = threading.Event()
        self._reader: Optional[threading.Thread] = None

    def __enter__(self) -> "PowerSampler":
        if self.uuid is None:
            return self
        try:
            import pynvml as nvml
        except ImportError:
            self.why = f"no NVML binding in this Python (the pynvml module): {INSTALL}"
            return self
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:  # no driver, no libnvidia-ml
            self.why = f"NVML did not start: {e}"
            return self
        self._nvml = nvml
        try:
            read = readings(nvml, nvml.nvmlDeviceGetHandleByUUID(self.uuid))
        except nvml.NVMLError as e:
            self.why = f"NVML cannot find {self.uuid}: {e}"
            return self
        self._reader = threading.Thread(target=self._read, args=(read,), name="gpu-power", daemon=True)
        self._reader.start()
        return self

    def _read(self, read: Dict[str, Callable[[], float]]) -> None:
        while True:
            sample = {}
            for name, value in read.items():
                try:
                    sample[name] = float(value())
                except self._nvml.NVMLError as e:  # not supported on this GPU: left out
                    self.unread.setdefault(name, str(e))
            self.samples.append((time.monotonic(), sample))
            if self._stop.wait(self.interval_ms / 1e3):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._nvml is not None:
            self._nvml.nvmlShutdown()

    def window(self, start: float, end: float, step_ms: float) -> Optional[Dict[str, Any]]:
        """What the samples between ``start`` and ``end`` (time.monotonic()) say: the mean power (W: the energy
        counter's joules between the first and last sample over their seconds, ``energy_j`` of them) and
        ``joules_per_step`` (that power times ``step_ms``), the median SM clock (MHz), the power limit, the
        hottest temperature, and the fraction of samples whose clocks were lowered to hold the power limit.
        ``unread``: what NVML could not read on this GPU. Fewer than MIN_SAMPLES: only ``samples`` and ``why``.
        None where sampling was off."""
        if self.uuid is None:
            return None
        inside = [(t, s) for t, s in self.samples if start <= t <= end]
        if len(inside) < MIN_SAMPLES:
            why = self.why or (f"{len(inside)} samples in {end - start:.2f} s, fewer than {MIN_SAMPLES}: time "
                               f"more steps")
            return {"samples": len(inside), "why": why}

        def median(field: str) -> Optional[float]:
            values = [s[field] for _, s in inside if field in s]
            return statistics.median(values) if values else None

        counted = [(t, s["energy_mj"]) for t, s in inside if "energy_mj" in s]
        energy_j = (counted[-1][1] - counted[0][1]) / 1e3 if len(counted) > 1 else None
        seconds = counted[-1][0] - counted[0][0] if len(counted) > 1 else 0.0
        power = energy_j / seconds if energy_j is not None and seconds > 0 else median("power_w")
        reasons = [int(s["clock_event_reasons"]) for _, s in inside if "clock_event_reasons" in s]
        temperatures = [s["temperature_c"] for _, s in inside if "temperature_c" in s]
        return {"samples": len(inside), "power_w": power, "power_limit_w": median("power_limit_w"),
                "sm_clock_mhz": median("sm_clock_mhz"),
                "power_capped_fraction": (sum(1 for r in reasons if r & SW_POWER_CAP) / len(reasons)
                                          if reasons else None),
                "temperature_max_c": max(temperatures) if temperatures else None,
                "joules_per_step": power * step_ms / 1e3 if power is not None else None,
                "energy_j": energy_j, "energy_from": "energy counter" if energy_j is not None else "power samples",
                **({"unread": dict(self.unread)} if self.unread else {})}


def describe(power: Optional[Dict[str, Any]]) -> str:
    """One line for a script's output."""
    if not power:
        return "power: not sampled"
    if "power_w" not in power:
        return f"power: not measured ({power.get('why')})"
    def shown(key: str, form: str) -> str:  # a field NVML could not read: "?"
        return "?" if power.get(key) is None else form.format(power[key])

    capped = power.get("power_capped_fraction")
    return (f"power: {shown('power_w', '{:.0f}')} W of {shown('power_limit_w', '{:.0f}')}, "
            f"SM {shown('sm_clock_mhz', '{:.0f}')} MHz, {shown('joules_per_step', '{:.2f}')} J a step"
            + (f", power-capped in {100 * capped:.0f}% of {power['samples']} samples" if capped is not None else ""))
