"""The suite's second stream (helpers/two_streams.py), run for real: a small suite in a temporary directory whose
conftest names one file as the second stream's, under plain pytest processes as the README's `pytest` starts them."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.paths import ROOT
from helpers.two_streams import SECOND_STREAM

CONFTEST = '''
from helpers import two_streams

two_streams.SECOND_STREAM.clear()
two_streams.SECOND_STREAM["test_second.py"] = 60.0


def pytest_configure(config):
    config.pluginmanager.register(two_streams, "two_streams")
'''

# Each test records its process and when it ran, and takes a second: run one after another, six take six seconds.
TESTS = '''
import os, sys, time
import pytest

def record(name):
    began = time.monotonic()
    time.sleep(1.0)
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{{name}} {{os.getpid()}} {{began:.3f}} {{time.monotonic():.3f}}\\n")

def test_{0}_passes():
    record("{0}_passes")

def test_{0}_fails():
    record("{0}_fails")
    assert 1 + 1 == 3, "{0}'s own message"

@pytest.mark.skip(reason="{0} skips")
def test_{0}_skips():
    pass

def test_{0}_prints_and_passes():
    print("{0} printed this")
    record("{0}_prints")

@pytest.mark.fast
@pytest.mark.parametrize("n", range(3))
def test_{0}_fast(n):
    pass
'''


def suite_env(folder: Path) -> dict:
    """The small suite's environment: helpers importable, its record file, its own TMPDIR (where a failed second
    stream's log is kept), two streams on (whatever the session running this test was told)."""
    (folder / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
            "RECORD": str(folder / "record.txt"), "TMPDIR": str(folder / "tmp"), "TESTS_TWO_STREAMS": "1"}


def run_suite(folder: Path, *args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args], cwd=folder,
                          capture_output=True, text=True, timeout=timeout, env={**suite_env(folder), **(env or {})})


@pytest.fixture
def suite(tmp_path) -> Path:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 60\nmarkers =\n    fast: in-process\n")
    for name in ("first", "second"):
        (tmp_path / f"test_{name}.py").write_text(TESTS.format(name))
    return tmp_path


def recorded(folder: Path):
    rows = [line.split() for line in (folder / "record.txt").read_text().splitlines()]
    return {name: (int(pid), float(began), float(ended)) for name, pid, began, ended in rows}


def test_the_second_streams_tests_run_beside_the_first_and_report_as_one_session(suite):
    began = time.monotonic()
    done = run_suite(suite)
    took = time.monotonic() - began
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    assert re.search(r"2 failed, 10 passed, 2 skipped", out), out[-3000:]
    for name in ("first", "second"):  # every test named in the summary, the failures with their own message
        assert f"FAILED test_{name}.py::test_{name}_fails - AssertionError: {name}'s own message" in out, out[-3000:]
        assert f"PASSED test_{name}.py::test_{name}_passes" in out and f"SKIPPED [1] test_{name}.py" in out, out
        assert f"{name} printed this" in out, out[-3000:]  # -rA shows passed tests' output: replayed too
    assert re.search(r"two streams: the second pytest ran 7 tests in \d+ s; this one then waited \d+ s", out), out
    runs = recorded(suite)
    first = {runs[f"first_{t}"][0] for t in ("passes", "fails", "prints")}
    second = {runs[f"second_{t}"][0] for t in ("passes", "fails", "prints")}
    assert len(first) == 1 and len(second) == 1 and first != second, runs  # two processes, one a stream
    # ... at the same time: the second stream's first test began before the first stream's last one ended
    assert runs["second_passes"][1] < runs["first_prints"][2], runs
    assert took < 6 + 30, took  # six one-second tests, less than one after another plus start-up


def test_one_stream_when_turned_off_or_when_one_kind_or_too_little_of_the_second_is_chosen(suite):
    """Off; only the second stream's file chosen; a quarter of its tests chosen (-k: its 60 s measured, 15 s
    expected, under the 40 s that starting a second pytest must be worth); half of its launching tests and its
    three `fast` ones (which count none of the file's seconds: 30 s expected, where a share of all its tests would
    be 5 of 7, 43 s): every test in this pytest."""
    for args, env in (((), {"TESTS_TWO_STREAMS": "0"}), (("test_second.py",), {}), (("-k", "passes"), {}),
                      (("-k", "fast or fails or passes and not prints"), {})):
        (suite / "record.txt").unlink(missing_ok=True)
        done = run_suite(suite, *args, env=env)
        assert done.returncode in (0, 1) and "passed" in done.stdout, done.stdout[-3000:]
        pids = {pid for pid, _, _ in recorded(suite).values()}
        assert len(pids) == 1 and len(recorded(suite)) >= 2, (args, env, done.stdout[-3000:])


def test_a_second_stream_that_dies_fails_its_remaining_tests_by_name_and_nothing_hangs(suite):
    (suite / "test_second.py").write_text(TESTS.format("second").replace(
        'def test_second_fails():\n    record("second_fails")', 'def test_second_fails():\n    os._exit(3)'))
    done = run_suite(suite, timeout=90)
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    left = ("test_second_fails", "test_second_skips", "test_second_prints_and_passes",
            *(f"test_second_fast[{n}]" for n in range(3)))
    for test in left:
        assert f"ERROR test_second.py::{test} - " in out and f"ERROR at setup of {test}" in out, out[-3000:]
    assert out.count("ERROR at setup of") == len(left), out[-3000:]  # each once in the errors' section
    errors = out[out.index("= ERRORS ="):out.index("= FAILURES =")]
    assert errors.count("the second stream's pytest ended (exit 3) before reporting this test") == len(left), errors
    assert "PASSED test_second.py::test_second_passes" in out, out[-3000:]  # reported before it died


@pytest.mark.fast
def test_the_second_streams_files_exist():
    """A renamed or removed test file would leave the table naming nothing: every entry is a test file here."""
    assert SECOND_STREAM, "helpers/two_streams.py names no file"
    missing = [f for f in SECOND_STREAM if not (ROOT / f).is_file()]
    assert not missing, missing


def test_ctrl_c_ends_both_pytests_at_once(suite):
    """Ctrl-C reaches this pytest (the second runs in a session of its own): it ends the second at once rather than
    waiting out its tests, and leaves no process of it."""
    (suite / "test_second.py").write_text(TESTS.format("second").replace(
        'def test_second_passes():\n    record("second_passes")',
        'def test_second_passes():\n    open(os.environ["RECORD"] + ".pid", "w").write(str(os.getpid()))\n'
        '    time.sleep(120)'))
    parent = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"], cwd=suite,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=suite_env(suite))
    try:
        pid_file = suite / "record.txt.pid"
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, "the second stream's test never started"
            time.sleep(0.1)
        second = int(pid_file.read_text())
        parent.send_signal(signal.SIGINT)
        began = time.monotonic()
        out, _ = parent.communicate(timeout=30)
        took = time.monotonic() - began
    finally:
        parent.kill()
    assert parent.returncode == 2 and "KeyboardInterrupt" in out, out[-3000:]  # pytest's exit for an interruption
    assert took < 15, f"{took:.1f} s to end after Ctrl-C"
    deadline = time.monotonic() + 10
    while psutil.pid_exists(second) and psutil.Process(second).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the second pytest (pid {second}) outlived the first"
        time.sleep(0.1)
