"""What a profiled training step's GPU work was: busy time, idle gaps, streams, collectives beside compute, the
busiest kernels, and the kernels by kind (matmuls, attention, collectives, ...). Read from torch.profiler's
events; used by scripts/profile_step.py (this repo's step) and scripts/lib/torchtitan_worker.py (torchtitan's),
so both sides of scripts/bench_torchtitan.py are read the same way.

``events``: a profile's GPU events of one device (``name``, ``device_time`` in us, ``time_range``, and the
stream as ``device_resource_id``), over ``steps`` steps; every figure is per step.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Sequence, Tuple

# Kernel kinds, first match wins: (kind, a regular expression over the kernel's name, case-insensitive). The
# order matters: fused AdamW runs through multi_tensor_apply, and cuDNN's attention kernels name "sm90" too.
KINDS: Sequence[Tuple[str, str]] = (
    ("collectives (NCCL)", r"^nccl"),
    ("attention", r"flash|fmha|sdpa|attention|attn"),
    ("matmuls", r"nvjet|gemm|cutlass|xmma|cublas|splitkreduce|matmul|^triton_tem"),  # tem: inductor's templates
    ("optimizer (fused Adam)", r"adam"),
    ("foreach (clipping, FSDP2 copy-in)", r"multi_tensor_apply|foreach"),
    ("FSDP2 copies (chunk_cat, split)", r"chunk_cat|split_with_sizes"),
    ("memory copies and sets", r"^memcpy|^memset|copy_kernel|catarraybatchedcopy"),
    ("fused kernels (Triton)", r"^triton"),
    ("other elementwise and reductions", r"elementwise|reduce_kernel|reduction"),
)
OTHER = "other"


def kernel_kind(name: str) -> str:
    """``name``'s kind (``KINDS``), or ``OTHER``."""
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return OTHER


def kinds_table(events, steps: int) -> List[Dict[str, Any]]:
    """ms and kernels per step of each kind (``kernel_kind``), in ``KINDS``' order, kinds with no kernel left out."""
    ms: Dict[str, float] = {}
    count: Dict[str, int] = {}
    for e in events:
        kind = kernel_kind(e.name)
        ms[kind] = ms.get(kind, 0.0) + e.device_time / 1e3
        count[kind] = count.get(kind, 0) + 1
    order = [kind for kind, _ in KINDS] + [OTHER]
    return [{"kind": kind, "ms_per_step": ms[kind] / steps, "per_step": count[kind] / steps}
            for kind in order if kind in ms]


def top_kernels(events, steps: int, n: int) -> List[Dict[str, Any]]:
    """The ``n`` GPU ops with the most time per step: name, ms per step, launches per step."""
    by_name: Dict[str, Tuple[float, int]] = {}
    for e in events:
        ms, count = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (ms + e.device_time / 1e3, count + 1)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": name, "ms_per_step": ms / steps, "per_step": count / steps} for name, (ms, count) in rows]


def is_collective(name: str) -> bool:
    return name.lower().startswith("nccl")


def spans_of(events) -> List[Tuple[float, float, str, Any]]:
    """(start us, end us, kernel name, stream) of each event."""
    return [(e.time_range.start, e.time_range.end, e.name, e.device_resource_id) for e in events]


def stream_table(spans, steps: int, busiest: int = 3) -> List[Dict[str, Any]]:
    """Per CUDA stream (``spans``: ``spans_of``): ms and ops per step and its ``busiest`` kernels, the stream with
    the most time first."""
    by_stream: Dict[Any, Dict[str, float]] = {}
    for start, end, name, stream in spans:
        kernels = by_stream.setdefault(stream, {})
        kernels[name] = kernels.get(name, 0.0) + (end - start)
    rows = []
    for stream, kernels in by_stream.items():
        ops = sum(1 for *_, s in spans if s == stream)
        top = sorted(kernels, key=lambda k: -kernels[k])[:busiest]
        rows.append({"stream": stream, "ms_per_step": sum(kernels.values()) / 1e3 / steps, "ops_per_step": ops / steps,
                     "busiest": top, "collectives": any(is_collective(k) for k in kernels)})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def union(spans) -> List[List[float]]:
    """The time covered by ``spans`` ((start, end, ...) tuples) as disjoint [start, end] intervals, in order."""
    merged: List[List[float]] = []
    for start, end, *_ in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def collective_overlap(spans, steps: int) -> Tuple[float, float]:
    """(ms per step of collective kernels, ms per step of it during which another, non-collective kernel ran)."""
    merged = union(span for span in spans if not is_collective(span[2]))  # the union of compute time
    total = beside = 0.0
    for start, end, name, _ in spans:
        if not is_collective(name):
            continue
        total += end - start
        beside += sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged if a < end and b > start)
    return total / 1e3 / steps, beside / 1e3 / steps


def idle_gaps(events, steps: int, n: int) -> Tuple[float, List[Dict[str, Any]]]:
    """The GPU's idle time per step (no op running on any stream), and the ``n`` op boundaries
    with the most of it: ms per step, gaps per step, the op that ended before and the one
    that started after."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    if not spans:
        return 0.0, []
    by_pair: Dict[Tuple[str, str], Tuple[float, int]] = {}
    idle_us = 0.0
    busy_until, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > busy_until:
            gap = start - busy_until
            idle_us += gap
            us, count = by_pair.get((last, name), (0.0, 0))
            by_pair[last, name] = (us + gap, count + 1)
        if end > busy_until:
            busy_until, last = end, name
    rows = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:n]
    return idle_us / 1e3 / steps, [{"after": a, "before": b, "ms_per_step": us / 1e3 / steps, "per_step": c / steps}
                                   for (a, b), (us, c) in rows]


def kernel_diff(first: Sequence[Dict[str, Any]], second: Sequence[Dict[str, Any]], n: int = 15
                ) -> List[Dict[str, Any]]:
    """Two steps' ``top_kernels`` matched by name: each kernel's ms and launches per step on either side (None
    where that side's list lacks it) and ``diff_ms``, the second's ms minus the first's (a missing side counts
    0), the ``n`` largest differences first. A kernel in one list only may still run on the other side below its
    list's cutoff: compare lists long enough to hold each other's tails."""
    a, b = ({row["name"]: row for row in rows} for rows in (first, second))
    rows = [{"name": name, "first_ms": a[name]["ms_per_step"] if name in a else None,
             "first_per_step": a[name]["per_step"] if name in a else None,
             "second_ms": b[name]["ms_per_step"] if name in b else None,
             "second_per_step": b[name]["per_step"] if name in b else None,
             "diff_ms": (b[name]["ms_per_step"] if name in b else 0.0) - (a[name]["ms_per_step"] if name in a else 0.0)}
            for name in dict.fromkeys([*a, *b])]
    return sorted(rows, key=lambda r: -abs(r["diff_ms"]))[:n]


def summary(events, steps: int, top: int = 25, gaps: int = 8) -> Dict[str, Any]:
    """Everything above for one profile: busy and kernel ms per step, ops per step, the kinds, the collectives
    and how much of them ran beside compute, idle time and its largest gaps, the ``top`` kernels, the streams."""
    spans = spans_of(events)
    idle_ms, idle_rows = idle_gaps(events, steps, gaps)
    collective_ms, beside_ms = collective_overlap(spans, steps)
    return {"gpu_busy_ms": sum(end - start for start, end in union(spans)) / 1e3 / steps,
            "kernel_ms": sum(e.device_time for e in events) / 1e3 / steps, "gpu_ops_per_step": len(events) / steps,
            "kinds": kinds_table(events, steps), "collective_ms": collective_ms,
            "collective_beside_compute_ms": beside_ms, "idle_ms": idle_ms, "idle_gaps": idle_rows,
            "top_kernels": top_kernels(events, steps, top), "streams": stream_table(spans, steps)}


def device_events(prof, device: int) -> list:
    """``prof``'s kernels, copies and sets on ``device`` (this rank's GPU: the trace may hold another's peer
    copies). Not the GPU-side spans of ``record_function`` ranges (user annotations, such as an eager step's
    ``nccl:_all_gather_base``, ``Optimizer.step#AdamW.step`` or ``FSDP::all_gather``): they cover the kernels they
    name and would count their time twice, and only an eager step has them (a graph's replay shows none)."""
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.device_index in (device, -1)
            and not getattr(e, "is_user_annotation", False)]


def profile_steps(next_step: Callable[[], Any], count: int, device: int, top: int = 80) -> Dict[str, Any]:
    """``count`` calls of ``next_step`` under torch.profiler, read as ``summary`` reads a step: the GPU work per
    step on ``device`` (an index), ``{"steps": count, **summary}`` with its ``top`` kernels (enough of the tail to
    set beside another step's kernel by kernel). For a script's own loop after its timed steps
    (scripts/lib/torchtitan_worker.py, scripts/reference_gpt2.py), so that it times nothing."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(count):
            next_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return {"steps": count, **summary(device_events(prof, device), count, top=top)}
