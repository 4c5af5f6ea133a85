"""The CPU suite on two streams: this pytest, and a second pytest it starts for the files of ``SECOND_STREAM``.

One pytest is one stream of tests, and nearly every test keeps one core busy (an in-process test, or a launch whose
rank or agent does): on this project's 2-core CI machine the default suite used 1.02 cores on average (2026-12-03:
627 s wall, 641 s of CPU), the other core idle. So when a session holds enough of both, the tests of the files named
in ``SECOND_STREAM`` run in a second pytest, started as soon as collection ends, in a process of its own (a thread
here could hold a lock when an in-process test forks a worker: the hang tests/test_image_folder.py guards against).
This pytest runs the other tests first, then, in the second stream's place, replays the second pytest's reports of
its tests as if it had run them: setup, call and teardown, outcome, output, duration; so the terminal, ``-ra``,
``--durations``, ``-x`` and the exit status read one session. The second pytest writes each report as it comes
(pytest's own serialization, as pytest-xdist sends them) to a file this one reads.

tests/conftest.py registers this module as a plugin (its pytest_* functions are the hooks).
Two streams, not more: the suite's launches start two ranks of their own. Off (one stream, everything here):
- ``TESTS_TWO_STREAMS=0``; one core; ``--pdb``, ``-s`` (a person at the terminal), ``--collect-only``;
- a session without both kinds of tests, or whose second stream would be short (its files' measured seconds, in the
  share of their tests chosen, under ``MIN_SECOND_STREAM_S``): starting a second pytest costs seconds of its own.
The second pytest carries this session's process marker, so whatever it leaves behind ends with this session's
launches (tests/conftest.py); an interrupted session ends it.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from helpers.processes import launch_marked

ENABLE = "TESTS_TWO_STREAMS"  # "0": one stream
CHILD = "TESTS_TWO_STREAMS_CHILD"  # set in the second pytest: where its run's files are
MIN_SECOND_STREAM_S = 40.0
# The second stream's files and their measured seconds (pytest --durations=0, this 2-core machine, one stream,
# 2026-12-03): about half of the default suite, files whose tests mostly launch. Whole files: a module fixture
# launches for several of a file's tests. None reads a session fixture of tests/conftest.py (each is read by two
# files, which would both have to move, or that launch would run in both pytests).
SECOND_STREAM: Dict[str, float] = {
    "tests/test_fault_table.py": 80.5,
    "tests/test_stall.py": 76.6,
    "tests/test_scripts.py": 61.7,
    "tests/test_launch_cleanup.py": 33.9,
    "tests/test_image_folder.py": 32.8,
}  # 285.5 s of the 580 s the default suite's tests took

_state: Dict[str, object] = {}


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def wanted(config: pytest.Config, items: List[pytest.Item]) -> Optional[List[pytest.Item]]:
    """The items for the second stream, or None where this session runs as one stream."""
    if os.environ.get(ENABLE, "1") == "0" or "child_work" in _state or (os.cpu_count() or 1) < 2:
        return None
    if config.option.usepdb or config.option.capture == "no" or config.option.collectonly:
        return None
    second = [item for item in items if _file(item) in SECOND_STREAM]
    if not second or len(second) == len(items):
        return None
    collected: Dict[str, int] = _state.get("collected", {})  # type: ignore[assignment]
    chosen = collections.Counter(_file(item) for item in second if not _fast(item))
    # each file's measured seconds, in the share of its launching (not `fast`) tests chosen: a few of them are not
    # worth a second pytest, and `fast` tests (in-process, tenths of a second; `pytest -m fast` chose 40 of these
    # files' 176 tests, 13 s of them) count none
    expected_s = sum(SECOND_STREAM[f] * n / max(n, collected.get(f, n)) for f, n in chosen.items())
    return second if expected_s >= MIN_SECOND_STREAM_S else None


def _fast(item: pytest.Item) -> bool:
    return item.get_closest_marker("fast") is not None


@pytest.hookimpl(tryfirst=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_before_deselection(items: List[pytest.Item]) -> None:
    """Before any deselection: how many launching (not ``fast``) tests each file has, for ``wanted``'s share of them
    chosen."""
    _state["collected"] = collections.Counter(_file(item) for item in items if not _fast(item))


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """After every deselection: starts the second pytest on the second stream's
    items and moves them to the end of this session's order."""
    if "child_work" in _state:
        return _keep_only_the_childs(config, items)
    second = wanted(config, items)
    if second is None:
        return
    work = Path(tempfile.mkdtemp(prefix="tests_second_stream_"))
    (work / "ids.json").write_text(json.dumps([item.nodeid for item in second]))
    reports = work / "reports.jsonl"
    reports.touch()
    env, _ = launch_marked({**os.environ, CHILD: str(work)})
    files = sorted({_file(item) for item in second}, key=[_file(i) for i in second].index)
    log = open(work / "output.log", "w")
    passed_on = [*(f"--override-ini={o}" for o in config.option.override_ini or ()),
                 *([f"--timeout={config.option.timeout}"] if getattr(config.option, "timeout", None) else [])]
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *passed_on, *files],
                             cwd=config.rootpath, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    log.close()
    _state.update(child=child, work=work, reader=open(reports, "rb"), pending={}, ids={item.nodeid for item in second},
                  started=time.monotonic(), waited_s=0.0)
    items[:] = [item for item in items if item.nodeid not in _state["ids"]] + second  # type: ignore[operator]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Optional[bool]:
    """For an item of the second stream: its reports, once the second pytest wrote them,
    told to this session's hooks as if it had run here. None for an item of this stream."""
    if item.nodeid not in _state.get("ids", ()):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    began = time.monotonic()
    reports = _reports_of(item)
    _state["waited_s"] += time.monotonic() - began  # type: ignore[operator]
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _reports_of(item: pytest.Item):
    """The item's reports (setup, call, teardown) from the second pytest, waiting for them while it runs; a failed
    setup report in their place where it ended without them or this wait was stopped (the suite's time limit)."""
    config = item.config
    pending: Dict[str, list] = _state["pending"]  # type: ignore[assignment]
    child: subprocess.Popen = _state["child"]  # type: ignore[assignment]
    reports: list = []
    try:
        while True:
            ended = child.poll() is not None  # before reading: what it wrote before it ended is in the file
            for data in _new_lines():
                report = config.hook.pytest_report_from_serializable(config=config, data=data)
                if isinstance(report.longrepr, list):  # a skip's (path, line, reason): JSON made the tuple a list
                    report.longrepr = tuple(report.longrepr)
                pending.setdefault(report.nodeid, []).append(report)
            reports = pending.get(item.nodeid, [])
            if reports and reports[-1].when == "teardown":
                return pending.pop(item.nodeid)
            if ended:
                why = f"the second stream's pytest ended (exit {child.returncode}) before reporting this test"
                break
            time.sleep(0.05)
    except pytest.fail.Exception as e:  # pytest-timeout's limit, reached while waiting
        why = f"waited for the second stream's pytest to report this test: {e}"
    return [*(r for r in reports if r.passed), _failed_setup(item, why)]


def _new_lines() -> list:
    """The reports the second pytest wrote since the last look, each a whole line."""
    reader = _state["reader"]
    lines = []
    for line in iter(reader.readline, b""):
        if not line.endswith(b"\n"):  # a line the second pytest is still writing: read it whole next time
            reader.seek(reader.tell() - len(line))
            break
        lines.append(json.loads(line))
    return lines


def _failed_setup(item: pytest.Item, why: str) -> pytest.TestReport:
    log = _state["work"] / "output.log"  # type: ignore[operator]
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    return pytest.TestReport(item.nodeid, item.location, {}, "failed", f"{why}; the end of its output ({log}):\n{tail}",
                             "setup", [], 0.0)


@pytest.hookimpl(tryfirst=True)  # before the session's fixtures end what its launches left
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The second pytest has ended (it should have: every report replayed) or is ended; a
    second pytest that ended badly (not 0, 1 or 5) fails this session too, its output's end said."""
    child: Optional[subprocess.Popen] = _state.get("child")  # type: ignore[assignment]
    if child is None:
        return
    # Ctrl-C (the second pytest, in a session of its own, did not get it), -x, --maxfail: its tests are not wanted
    stopped = bool(exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop or session.shouldfail)
    if stopped:
        end()
    try:
        code = child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        end(signal.SIGKILL)
        code = child.wait()
    _state["second_s"] = time.monotonic() - _state["started"]  # type: ignore[operator]
    _state["reader"].close()  # type: ignore[attr-defined]
    if code not in (0, 1, 5) and not stopped:
        log = _state["work"] / "output.log"  # type: ignore[operator]
        print(f"\nthe second stream's pytest ended with exit {code}; the end of its output ({log}, kept):\n"
              f"{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        shutil.rmtree(_state["work"], ignore_errors=True)  # type: ignore[arg-type]


def pytest_terminal_summary(terminalreporter) -> None:
    """One line on how the two streams shared the time, for the next balance of ``SECOND_STREAM``: the second
    pytest's time from its start to its end, and how long this one waited for its reports after its own tests."""
    if "second_s" in _state:
        terminalreporter.write_line(
            f"two streams: the second pytest ran {len(_state['ids'])} tests in {_state['second_s']:.0f} s; this one "
            f"then waited {_state['waited_s']:.0f} s for their reports (helpers/two_streams.py)")


def pytest_unconfigure() -> None:
    end()


def end(sig: int = signal.SIGTERM) -> None:
    """Ends the second pytest's process group, if it runs (an interrupted session)."""
    child: Optional[subprocess.Popen] = _state.get("child")  # type: ignore[assignment]
    if child is not None and child.poll() is None:
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass


# --- in the second pytest ---

def _keep_only_the_childs(config: pytest.Config, items: List[pytest.Item]) -> None:
    work = Path(_state["child_work"])  # type: ignore[arg-type]
    ids = set(json.loads((work / "ids.json").read_text()))
    dropped = [item for item in items if item.nodeid not in ids]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = [item for item in items if item.nodeid in ids]
    _state["writer"] = open(work / "reports.jsonl", "a")


def pytest_configure(config: pytest.Config) -> None:
    """In the second pytest, the marker of its role leaves the environment (a pytest that one of
    its tests starts, tests/test_suite_limits.py, is a session of its own)."""
    _state["config"] = config
    if os.environ.get(CHILD):
        _state["child_work"] = os.environ.pop(CHILD)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the second pytest: the report, serialized, one line each, flushed."""
    writer = _state.get("writer")
    if writer is not None:
        config = _state["config"]
        data = config.hook.pytest_report_to_serializable(config=config, report=report)  # type: ignore[attr-defined]
        writer.write(json.dumps(data) + "\n")
        writer.flush()
