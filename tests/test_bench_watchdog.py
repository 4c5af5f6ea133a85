"""scripts/bench_watchdog.py: what it refuses before any run (its measurement needs a GPU: RESULTS.md)."""
from __future__ import annotations

import pytest

from scripts.bench_watchdog import main


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", [
    (["train.stall_timeout_s=5"], "'train.stall_timeout_s=5' is set by this script for every run"),
    (["--", "train.max_steps=9"], "'train.max_steps=9' is set by this script for every run"),
    (["recipe.nope=1"], "bench_watchdog.py: Could not override 'recipe.nope'"),
    (["--steps", "10"], "--steps must be at least 30"),
    (["--repeats", "0"], "--repeats at least 1"),
])
def test_what_it_would_not_measure_is_refused_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
