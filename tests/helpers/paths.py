"""Where the checkout and its tests are."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: train.py, conf/, scripts/, docs/
TESTS = ROOT / "tests"  # on a launch's PYTHONPATH, it makes ``helpers`` importable there (as pytest.ini does here)
