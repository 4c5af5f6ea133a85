"""Reads an offline W&B run back from disk, the way `wandb sync` would see it.

wandb keeps an offline run's history, summary and config only in ``run-<id>.wandb``:
a ``:W&B`` header, then a LevelDB-style log of 32 KiB blocks, each record framed by a
7-byte header (crc32c: 4, length: 2, type: 1) and split across blocks as FULL, or
FIRST/MIDDLE/LAST pieces. Each reassembled record is a protobuf ``Record``.
"""
from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes) -> List[bytes]:
    magic = data[:4]
    if magic != b":W&B":
        raise ValueError(f"not a W&B run file (starts with {magic!r})")
    pos, out, pending = 7, [], b""  # header: ':W&B' + 2-byte version + 1-byte magic
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer: padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        if kind == FULL:
            out.append(payload)
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            out.append(pending + payload)
            pending = b""
    return out


@dataclass
class OfflineRun:
    run_id: str = ""
    group: str = ""
    job_type: str = ""
    project: str = ""
    tags: List[str] = field(default_factory=list)
    config: Dict[str, Any] = field(default_factory=dict)
    history: List[Dict[str, Any]] = field(default_factory=list)
    summary: Dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None

    def keys(self) -> set:
        return {k for row in self.history for k in row}


def _value(item) -> Any:
    text = item.value_json
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: Path, wait_s: float = 30.0) -> OfflineRun:
    """The run in ``path``, read once its exit record is there: ``run.finish()`` (and a process's
    exit) can return before W&B's service has written the file out, seen under load (the run
    record itself missing). Waits up to ``wait_s`` for it; a run without one is read as it is."""
    deadline = time.monotonic() + wait_s
    while True:
        run = _read_run(path)
        if run.exit_code is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def _read_run(path: Path) -> OfflineRun:
    run = OfflineRun()
    for raw in _records(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.run_id, run.group, run.job_type, run.project = r.run_id, r.run_group, r.job_type, r.project
            run.tags = list(r.tags)
            for item in r.config.update:
                run.config[_key(item)] = _value(item)
        elif kind == "config":
            for item in rec.config.update:
                run.config[_key(item)] = _value(item)
        elif kind == "history":
            run.history.append({_key(item): _value(item) for item in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                run.summary[_key(item)] = _value(item)
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    return run


def find_runs(run_dir: Path) -> List[Path]:
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
