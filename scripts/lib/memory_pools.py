"""What each CUDA memory pool of a run holds, from the caching allocator's snapshot with its history
(``torch.cuda.memory._snapshot()`` after ``torch.cuda.memory._record_memory_history()``): per pool (the default
pool, and each CUDA graph's private one) and per stream, the memory reserved (cudaMalloc'd segments), the most
that was live at once, and the most that was freed but not yet reusable (a free waits for the streams that used
the block, and during a capture such frees wait until the capture ends). Reserved far above the peak live is
memory the pool could not reuse: what ``scripts/profile_step.py --memory`` shows for this repo's graphs.

Pure functions over the snapshot's dictionaries (its documented format: torch/cuda/memory.py ``_snapshot``).
"""
from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional, Sequence, Tuple

DEFAULT_POOL = (0, 0)  # the allocator's own pool; a graph's private pool has another id
MIB = 2 ** 20
# A segment's memory comes and goes as cudaMalloc/cudaFree, or, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
# as pages mapped into and unmapped from one growing segment per stream.
SEGMENT_GROWS = ("segment_alloc", "segment_map")
SEGMENT_SHRINKS = ("segment_free", "segment_unmap")


def _pool(value: Any) -> Tuple[int, int]:
    return tuple(value) if value is not None else DEFAULT_POOL  # type: ignore[return-value]


class _Segments:
    """Which pool a trace entry's address belongs to, for traces that do not name it: the segments of the
    snapshot, by address (a graph's segments outlive its capture, so they are all still there)."""

    def __init__(self, segments: Sequence[Dict[str, Any]]):
        spans = sorted((s["address"], s["address"] + s["total_size"], _pool(s.get("segment_pool_id"))) for s in segments)
        self.starts = [start for start, _, _ in spans]
        self.spans = spans

    def pool_of(self, address: Optional[int]) -> Optional[Tuple[int, int]]:
        if address is None:
            return None
        i = bisect.bisect_right(self.starts, address) - 1
        if i >= 0 and address < self.spans[i][1]:
            return self.spans[i][2]
        return None


def _history() -> Dict[str, Any]:
    """The counters a pool, and each of its streams, keeps over the history: bytes now (``_``) and the peaks."""
    return {"_live": 0, "_waiting": 0, "_segments": 0, "peak_live_mib": 0.0, "peak_waiting_mib": 0.0,
            "segments_mib": 0.0}


def pool_report(snapshot: Dict[str, Any], device: int = 0) -> List[Dict[str, Any]]:
    """One row per pool, the default pool first: ``pool`` (its id), ``graph`` (a private pool), ``reserved_mib``
    and ``allocated_mib`` now (its segments), ``segments``, and from the history, for the pool and per
    ``streams`` entry: ``segments_mib`` (the most it held in segments at once over the history),
    ``peak_live_mib`` (the most allocated at once) and ``peak_waiting_mib`` (the most freed by the program
    but not yet given back to the pool when it next allocated: blocks other streams had used, whose frees wait
    on their events)."""
    segments = snapshot.get("segments", [])
    where = _Segments(segments)
    rows: Dict[Tuple[int, int], Dict[str, Any]] = {}

    def row(pool: Tuple[int, int]) -> Dict[str, Any]:
        if pool not in rows:
            rows[pool] = {"pool": list(pool), "graph": pool != DEFAULT_POOL, "reserved_mib": 0.0, "allocated_mib": 0.0,
                          "segments": 0, "streams": {}, **_history()}
        return rows[pool]

    for segment in segments:
        r = row(_pool(segment.get("segment_pool_id")))
        r["reserved_mib"] += segment["total_size"] / MIB
        r["allocated_mib"] += segment.get("allocated_size", 0) / MIB
        r["segments"] += 1

    traces = snapshot.get("device_traces") or []
    for entry in (traces[device] if device < len(traces) else []):
        pool = _pool(entry["pool_id"]) if entry.get("pool_id") is not None else where.pool_of(entry.get("addr"))
        if pool is None:
            continue  # a block of a segment since freed, in a pool the trace does not name
        r = row(pool)
        stream = r["streams"].setdefault(str(entry.get("stream", 0)), _history())
        size, action = entry.get("size", 0), entry.get("action")
        for acc in (r, stream):
            if action == "alloc":
                acc["_live"] += size
            elif action == "free_requested":
                acc["_live"] -= size
                acc["_waiting"] += size
            elif action == "free_completed":
                acc["_waiting"] -= size
            elif action in SEGMENT_GROWS:
                acc["_segments"] += size
            elif action in SEGMENT_SHRINKS:
                acc["_segments"] -= size
            acc["peak_live_mib"] = max(acc["peak_live_mib"], acc["_live"] / MIB)
            if action == "alloc" or action in SEGMENT_GROWS:  # what was stuck when memory was wanted (a free completed
                acc["peak_waiting_mib"] = max(acc["peak_waiting_mib"], acc["_waiting"] / MIB)  # at once never is)
            acc["segments_mib"] = max(acc["segments_mib"], acc["_segments"] / MIB)
    out = []
    for pool in sorted(rows, key=lambda p: (p != DEFAULT_POOL, p)):
        r = {k: v for k, v in rows[pool].items() if not k.startswith("_")}
        r["streams"] = {s: {k: v for k, v in acc.items() if not k.startswith("_")} for s, acc in r["streams"].items()}
        out.append(r)
    return out


def describe(rows: Sequence[Dict[str, Any]], names: Optional[Dict[str, str]] = None) -> List[str]:
    """``pool_report``'s rows as lines: each pool, then its streams with the most segment memory first, each with
    its name where ``names`` (stream id -> what it is) has one."""
    names = names or {}
    lines = []
    for r in rows:
        name = f"graph pool {tuple(r['pool'])}" if r["graph"] else "default pool"
        lines.append(f"  {name}: reserved {r['reserved_mib']:,.0f} MiB in {r['segments']} segments, allocated now "
                     f"{r['allocated_mib']:,.0f}; most live at once {r['peak_live_mib']:,.0f} MiB, most waiting to be "
                     f"freed {r['peak_waiting_mib']:,.0f} MiB")
        for stream, acc in sorted(r["streams"].items(), key=lambda kv: -kv[1]["segments_mib"]):
            label = f"stream {stream} ({names[stream]})" if stream in names else f"stream {stream}"
            lines.append(f"    {label}: segments {acc['segments_mib']:,.0f} MiB, most live "
                         f"{acc['peak_live_mib']:,.0f}, most waiting {acc['peak_waiting_mib']:,.0f}")
    return lines
