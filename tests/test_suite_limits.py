"""The suite's own limit: a test that hangs fails after pytest.ini's ``timeout`` seconds, naming itself,
instead of holding CI for its 90 minutes (pytest-timeout, in requirements.txt beside pytest)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest


@pytest.mark.fast
def test_the_suite_has_a_per_test_time_limit_of_minutes(pytestconfig):
    limit = float(pytestconfig.getini("timeout"))
    assert 60 <= limit <= 600, f"pytest.ini's timeout is {limit} s: a hung test must fail in minutes"


def test_a_hanging_test_fails_by_the_limit_and_is_named(tmp_path):
    (tmp_path / "test_stuck.py").write_text("import time\n\ndef test_waits_forever():\n    time.sleep(600)\n")
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=2",
                           str(tmp_path / "test_stuck.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "FAILED test_stuck.py::test_waits_forever" in done.stdout and "Timeout" in done.stdout, done.stdout[-2000:]
    assert time.monotonic() - began < 60
