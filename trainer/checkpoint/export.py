"""``checkpoint.export``'s directory: whose it is, and what a run does when it finds one.

An export is written into a temporary directory beside its name (``.NAME.tmp``), which is renamed to
NAME once whole (trainer/trainer.py ``Trainer.export``). Before the rename the trainer writes
``EXPORT_RECORD`` into it: the run directory and the step whose weights it holds. So a run that
finds NAME knows whose it is:

- absent: the run writes it at its end; a run that finished training before its export was whole
  (killed or restarted while writing it) writes it from its last checkpoint, the same command again;
  the temporary directory an earlier attempt left is removed first (``Trainer.export``);
- this run's record, of its last step: the export is done; the same command again leaves it as it is;
- anything else (another run's export, this run's of fewer steps than it now asks for, a directory no
  run wrote): refused, naming it. An export never writes over a directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainer.run.errors import ConfigError

EXPORT_RECORD = "exported_by_run.json"  # inside the export: {"run_dir": ..., "step": ...}


@dataclass(frozen=True)
class ExportRecord:
    run_dir: Path  # resolved
    step: int  # optimizer steps done when the weights were written


def export_directory(setting: Optional[str]) -> Optional[Path]:
    """``checkpoint.export`` as the absolute path it names (None: no export)."""
    return None if setting is None else Path(setting).expanduser().resolve()


def temp_export_dir(final: Path) -> Path:
    """Where an export is written until it is whole: beside ``final``, hidden."""
    return final.parent / f".{final.name}.tmp"


def write_export_record(directory: Path, run_dir: Path, step: int) -> None:
    """The record of whose export ``directory`` holds; written before the directory takes its final name."""
    record = {"run_dir": str(Path(run_dir).resolve()), "step": int(step)}
    (directory / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def read_export_record(final: Path) -> Optional[ExportRecord]:
    """The record inside the export ``final``; None where there is none (or it cannot be read)."""
    try:
        record = json.loads((final / EXPORT_RECORD).read_text())
        return ExportRecord(Path(record["run_dir"]), int(record["step"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_export_target(final: Path, run_dir: Optional[Path], may_be_this_run: bool) -> None:
    """The plan's check, before the run directory is known to every rank: refuses an existing ``final`` that
    cannot be this run's. ``run_dir``: ``run_dir=`` as set (None: chosen at start, a new one unless
    ``may_be_this_run``, a torchrun restart finding its job's directory); the rest is decided by
    ``export_is_done`` once the run has resumed."""
    if not final.exists():
        return
    record = read_export_record(final)
    run_dir = None if run_dir is None else Path(run_dir).expanduser().resolve()
    if record is not None and (record.run_dir == run_dir if run_dir is not None else may_be_this_run):
        return
    raise ConfigError(_exists(final, record, run_dir))


def export_is_done(final: Path, run_dir: Path, steps: Optional[int]) -> bool:
    """Whether ``final`` holds this run's export of its last step, ``steps`` (None: no step completes it): True,
    nothing to write; False, no export yet. Anything else there is refused, naming it."""
    if not final.exists():
        return False
    record = read_export_record(final)
    run_dir = Path(run_dir).resolve()
    if record is not None and record.run_dir == run_dir and steps is not None and record.step >= steps:
        return True
    raise ConfigError(_exists(final, record, run_dir, steps))


def _exists(final: Path, record: Optional[ExportRecord], run_dir: Optional[Path], steps: Optional[int] = None) -> str:
    if record is None:
        whose = "a directory that no run's export wrote"
    elif run_dir is not None and record.run_dir == run_dir:
        whose = f"this run's export of step {record.step}" + ("" if steps is None else
                                                              f", and the run now goes on to step {steps}")
    else:
        whose = f"the export of another run ({record.run_dir}, step {record.step})"
    return (f"checkpoint.export={str(final)!r} exists: it holds {whose}. An export never writes over a directory: "
            "set checkpoint.export=<a new directory>, or move that one away")
