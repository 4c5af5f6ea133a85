"""``checkpoint.export``: a run writes its trained model at its end, and the same command again finishes it.

| what happened before                                        | the same command again                        |
|-------------------------------------------------------------|-----------------------------------------------|
| killed while writing the export (after its last checkpoint) | writes the export from that checkpoint, exit 0 |
| complete, with its export                                   | changes nothing, exit 0                        |
| complete, asked now for more steps                          | refused: its export would be written over      |
| another run's export, or a directory no run wrote            | refused, exit 2, naming it                     |

The recipe here is a user's (``recipe._target_=test_export.points``): a linear model whose export is one
file of its weights; ``KILL_IN_EXPORT`` makes it die half-way through writing it, as a process killed there.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.launches import launch
from helpers.paths import ROOT
from trainer.checkpoint.export import EXPORT_RECORD, read_export_record
from trainer.recipe import Datasets, Recipe, Split, top1_correct

KILL_IN_EXPORT = "GRAPHED_DDP_TEST_KILL_IN_EXPORT"
WEIGHTS = "weights.pt"


def export_weights(model: torch.nn.Module, directory: Path) -> None:
    state = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    if os.environ.get(KILL_IN_EXPORT):
        (directory / WEIGHTS).write_bytes(b"half a file")  # what a kill mid-write leaves
        os._exit(13)
    torch.save(state, directory / WEIGHTS)


def points(cfg, runtime) -> Recipe:
    g = torch.Generator().manual_seed(cfg.seed)

    def split(n):
        x = torch.randn(n, 2, generator=g)
        return Split(x, (x[:, 0] > 0).long())

    return Recipe(name=cfg.recipe.name, model=torch.nn.Linear(2, 2), data=Datasets(split(128), split(32), "points"),
                  preprocess=lambda batch, train: batch, criterion=F.cross_entropy, correct=top1_correct,
                  export=export_weights)


ARGS = ["recipe._target_=test_export.points", "recipe.name=points", "recipe.optim._target_=torch.optim.AdamW",
        "~recipe.optim.momentum", "recipe.data.batch_size=16", "recipe.data.eval_batch_size=32", "logger=none",
        "train.max_steps=4", "train.log_every=2", "train.progress=false", "device=cpu"]
TESTS_ON_PATH = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)}


def files(directory: Path):
    """Every file under ``directory`` with its bytes and modification time: what "changes nothing" compares."""
    return {p.relative_to(directory): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def last_checkpoint_weights(run_dir: Path):
    return torch.load(sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)["model"]


def test_a_run_killed_while_exporting_writes_the_export_when_run_again_and_then_leaves_it(tmp_path, train_here):
    run_dir, export = tmp_path / "run", tmp_path / "model"
    args = [*ARGS, f"run_dir={run_dir}", f"checkpoint.export={export}"]
    killed = launch(args, tmp_path / "first", env={**TESTS_ON_PATH, KILL_IN_EXPORT: "1"}, timeout=120)
    assert killed.returncode == 13, killed.output[-3000:]
    temp = tmp_path / ".model.tmp"
    assert (run_dir / "checkpoints" / "step_00000004.pt").is_file() and not export.exists()
    assert (temp / WEIGHTS).read_bytes() == b"half a file" and not (run_dir / "results.json").exists()

    again = train_here(args)  # the same command: the run is complete, its export is not
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is complete: 4 of 4 steps done" in again.stdout
    assert f"exported the trained model to {export}" in again.stdout
    written = torch.load(export / WEIGHTS, weights_only=True)
    final = last_checkpoint_weights(run_dir)
    assert written.keys() == final.keys() and all(torch.equal(written[k], final[k]) for k in final)
    record = read_export_record(export)
    assert (record.run_dir, record.step) == (run_dir.resolve(), 4)
    assert not temp.exists()  # the killed attempt's half-written directory is gone

    before, run_before = files(export), files(run_dir)
    third = train_here(args)  # complete, with its export: nothing to do
    assert third.returncode == 0, third.stderr[-3000:]
    assert "is complete" in third.stdout and f"its trained model exported to {export}" in third.stdout
    assert "exported the trained model" not in third.stdout
    assert files(export) == before and files(run_dir) == run_before and not temp.exists()

    more = train_here([*args, "train.max_steps=6"])  # more steps would write over this run's export of step 4
    assert more.returncode == 2
    assert "holds this run's export of step 4, and the run now goes on to step 6" in more.stderr
    assert files(export) == before


@pytest.mark.fast
def test_a_new_run_pointed_at_an_existing_export_is_refused_before_it_starts(tmp_path, train_here):
    export = tmp_path / "model"
    first = train_here([*ARGS, f"run_dir={tmp_path / 'run'}", f"checkpoint.export={export}"])
    assert first.returncode == 0 and (export / EXPORT_RECORD).is_file(), first.stderr[-3000:]
    before = files(export)
    for run_dir in (f"run_dir={tmp_path / 'other'}", "run_dir=null"):  # another directory, or a new dated one
        other = train_here([*ARGS, run_dir, f"checkpoint.export={export}"], tmp_path / "outputs")
        assert other.returncode == 2, other.stderr[-3000:]
        assert (f"checkpoint.export={str(export)!r} exists: it holds the export of another run "
                f"({(tmp_path / 'run').resolve()}, step 4)") in other.stderr
        assert "set checkpoint.export=<a new directory>" in other.stderr
    assert files(export) == before and not (tmp_path / "other").exists() and not (tmp_path / "outputs").exists()

    (export / EXPORT_RECORD).unlink()  # a directory no run's export wrote (copied, or written by hand)
    own = train_here([*ARGS, f"run_dir={tmp_path / 'run'}", f"checkpoint.export={export}"])
    assert own.returncode == 2 and "it holds a directory that no run's export wrote" in own.stderr


@pytest.mark.fast
def test_a_run_without_checkpoints_knows_its_export_by_its_record(tmp_path, train_here):
    # checkpoint.save=false: no checkpoint says the run is complete; its export's record does
    run_dir, export = tmp_path / "run", tmp_path / "model"
    args = [*ARGS, f"run_dir={run_dir}", f"checkpoint.export={export}", "checkpoint.save=false"]
    first = train_here(args)
    assert first.returncode == 0 and not list(run_dir.glob("checkpoints/*")), first.stderr[-3000:]
    before = files(export)
    again = train_here(args)
    assert again.returncode == 0 and "is complete: 4 of 4 steps done" in again.stdout, again.stderr[-3000:]
    assert files(export) == before


@pytest.mark.fast
def test_export_dtype_without_an_export_is_refused_naming_both_keys(train_here):
    done = train_here([*ARGS, "checkpoint.export_dtype=bf16"])
    assert done.returncode == 2
    assert ("checkpoint.export_dtype=bf16 is read only with checkpoint.export, which this run does not set: set "
            "checkpoint.export=<a new directory>, or drop checkpoint.export_dtype") in done.stderr
