"""scripts/bench_images.py: what it refuses before any run (its measurement: a GPU, scripts/results/RESULTS.md)."""
from __future__ import annotations

import pytest

from scripts.bench_images import main


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", [
    (["graph=full"], "'graph=full' is set by this script for every run"),
    (["recipe.data.num_workers=3"], "'recipe.data.num_workers=3' is set by this script for every run"),
    (["recipe.nope=1"], "bench_images.py: Could not override 'recipe.nope'"),
    (["--steps", "10"], "--steps must be at least 30"),
])
def test_what_it_would_not_measure_is_refused_naming_it(tmp_path, argv, message, capsys):
    (tmp_path / "train").mkdir()
    with pytest.raises(SystemExit) as exited:
        main(["--root", str(tmp_path), *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.fast
def test_a_root_without_train_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--root", str(tmp_path)])
    assert exited.value.code == 2
    assert f"--root {tmp_path} has no train/ folder" in capsys.readouterr().err


@pytest.mark.fast
def test_references_without_their_train_py_or_a_val_folder_are_named(tmp_path, capsys):
    (tmp_path / "train").mkdir()
    with pytest.raises(SystemExit) as exited:
        main(["--root", str(tmp_path), "--references", str(tmp_path / "vision")])
    assert exited.value.code == 2
    assert f"--references needs {tmp_path / 'vision'}/train.py" in capsys.readouterr().err


@pytest.mark.fast
def test_a_folder_whose_epoch_is_shorter_than_a_run_is_said_with_its_tail(tmp_path):
    """On 6,000 images a run of 60 steps of 256 held two epoch ends, and under full_compiled the first tail step's
    own compile sat inside the window (0.044 of the GPU-fed rate): the bench says so before it runs."""
    from scripts.bench_images import epoch_end_note

    for n in range(10):
        (tmp_path / "train" / f"c{n % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "train" / f"c{n % 2}" / f"{n}.jpg").write_bytes(b"")
    note = epoch_end_note(tmp_path, batch=4, steps=30)
    assert note == (f"note: an epoch of {tmp_path} is 3 steps of 4 (the last a tail of 2 images), fewer than a run's "
                    "30: its steps hold 9 epoch end(s) and their tail steps (under full_compiled the first "
                    "compiles a step of its own: tens of seconds inside the window); a folder of at least 120 images "
                    "times the step alone")
    assert "tail" not in epoch_end_note(tmp_path, batch=5, steps=30)  # 2 whole steps an epoch
    assert epoch_end_note(tmp_path, batch=1, steps=10) is None  # an epoch of 10 steps holds a run of 10
    dropped = epoch_end_note(tmp_path, batch=4, steps=30, drop_last=True)  # recipe.data.drop_last=true: no tail
    assert "tail" not in dropped and "an epoch of" in dropped and "is 2 steps of 4" in dropped
