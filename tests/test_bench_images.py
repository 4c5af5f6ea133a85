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
