"""A stopped run ends every one of its processes, ranks included (scripts/lib/launch.py, issue 47).

torchrun starts each rank in a session of its own, so killing torchrun (what ``subprocess.run``'s timeout
did) orphaned the ranks, which on a GPU machine kept their GPUs through the script's next run. Each test
here starts two gloo ranks that hang (tests/helpers/hanging_ranks.py) under torchrun, stops the run one way
(its timeout, a SIGTERM or Ctrl-C of the script) and checks that no process carrying the run's marker
(scripts/lib/process_tree.py) is left. Real launches (not ``fast``): 10 to 20 s each on 2 idle cores. Plain
interpreters, never warm forks (helpers/warm.py): torchrun and the scripts start ``sys.executable`` here, as they
do for a user.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, List, Tuple, TypeVar

import pytest

from helpers.processes import cmdline
from scripts.lib import launch, process_tree

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds processes through /proc")

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 8  # the ranks are in their group after about 5 s on 2 idle cores (later tries: 2x, then 6x)
T = TypeVar("T")


def hanging_ranks(pid_dir: Path, *flags: str) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "tests" / "helpers" / "hanging_ranks.py"), str(pid_dir), *flags]


@pytest.fixture
def mark(monkeypatch):
    """A marker of this test's own, in this process's environment: every run launched from here (or from a
    script this test starts) adds its own to it, so its processes carry this one too. Any of them still
    alive at the end (a failed test) is killed."""
    value = f"test-{uuid.uuid4().hex}"
    monkeypatch.setenv(process_tree.MARK, value)
    yield value
    process_tree.kill(process_tree.marked_pids(value))


def rank_pids(pid_dir: Path) -> List[int]:
    """The pids the ranks wrote once in their group, after checking each inherited the test's marker."""
    pids = []
    for file in sorted(pid_dir.glob("rank*.pid")):
        pid, marks = file.read_text().split("\n")[:2]
        assert os.environ[process_tree.MARK] in marks.split(","), f"{file.name}: no marker in {marks!r}"
        pids.append(int(pid))
    return pids


def wait_for_ranks(pid_dir: Path, launched: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(rank_pids(pid_dir)) < 2:
        assert launched.poll() is None, f"the script ended (exit {launched.returncode}) before its ranks started"
        assert time.monotonic() < deadline, f"the ranks did not start within {timeout:.0f} s"
        time.sleep(0.1)


def assert_all_ended(mark: str, pid_dir: Path) -> None:
    """Both ranks started (else there was nothing to end), and within a few seconds no process of the run
    is alive."""
    ranks = rank_pids(pid_dir)
    assert len(ranks) == 2, f"the ranks did not start before the run was stopped (pid files: {ranks})"
    deadline = time.monotonic() + 5
    # a process in the middle of its exit can hide its environment (no longer marked) and still be there: both waited
    while ((left := process_tree.marked_pids(mark)) or any(process_tree.is_live(pid) for pid in ranks)) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the stopped run still alive: {[cmdline(pid) for pid in left]}"
    assert not any(process_tree.is_live(pid) for pid in ranks), [cmdline(pid) for pid in ranks]


def past_its_timeout(run: Callable[[float, Path], T], tmp_path: Path) -> Tuple[T, float, Path]:
    """``run(timeout, pid_dir)``, a launch stopped by its timeout, tried again with a longer one where the
    ranks were not in their group before it (a loaded machine: beside the suite's other stream an 8 s try once
    came too early, and a 4x second try made the test 44 s): only a stop that finds them running shows anything.
    Returns what ``run`` did, its timeout and where the ranks wrote their pids."""
    for timeout in (TIMEOUT_S, 2 * TIMEOUT_S, 6 * TIMEOUT_S):
        pid_dir = tmp_path / f"ranks_{timeout}"
        pid_dir.mkdir()
        result = run(timeout, pid_dir)
        if len(rank_pids(pid_dir)) == 2:
            break
    return result, timeout, pid_dir


def test_run_captured_past_its_timeout_ends_ranks_that_ignore_sigterm(tmp_path, mark, monkeypatch, capsys):
    """The ranks ignore SIGTERM (as one stuck in a collective does): torchrun passes the SIGTERM on and
    waits for them; past the grace period every marked process is killed."""
    monkeypatch.setattr(launch, "STOP_GRACE_S", 2.0)
    (_, stderr, code), timeout, pid_dir = past_its_timeout(
        lambda timeout, pid_dir: launch.run_captured(hanging_ranks(pid_dir, "--ignore-sigterm"), timeout), tmp_path)
    assert code is None
    assert_all_ended(mark, pid_dir)
    assert "Received 15 death signal" in stderr  # torchrun's own shutdown, kept in what it printed
    said = capsys.readouterr().err
    assert f"stopped {sys.executable} -m torch.distributed.run" in said and f"(timeout after {timeout} s): " \
           "ended 3 processes" in said, said  # torchrun and its 2 ranks


def test_launch_mode_past_its_timeout_ends_its_ranks(tmp_path, mark, monkeypatch, capsys):
    monkeypatch.setattr(launch, "STOP_GRACE_S", 2.0)

    def launch_mode(timeout: float, pid_dir: Path):
        monkeypatch.setattr(launch, "command", lambda *args: hanging_ranks(pid_dir, "--ignore-sigterm"))
        return launch.launch_mode("eager", 2, [], tmp_path / "out", group="g", run_name="r", timeout=timeout,
                                  cuda=False)

    outcome, timeout, pid_dir = past_its_timeout(launch_mode, tmp_path)
    assert (outcome["status"], outcome["exit_code"]) == (f"timed out after {timeout} s", None)
    assert_all_ended(mark, pid_dir)
    assert f"stopped 'eager' (timeout after {timeout} s): ended 3 processes" in capsys.readouterr().err


def default_sigint() -> None:
    """SIGINT as a terminal gives the command a user types, whatever this suite inherited: a suite started in the
    background of a non-interactive shell (a CI runner's ``cmd &``) has it ignored, and an ignored SIGINT stays
    ignored across exec, so the script would never see the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig,why,code", [(signal.SIGTERM, "terminated", 128 + signal.SIGTERM),
                                          (signal.SIGINT, "interrupted", -signal.SIGINT)], ids=["sigterm", "ctrl-c"])
def test_a_script_stopped_while_its_run_hangs_ends_the_run_first(tmp_path, mark, sig, why, code):
    """A SIGTERM of the script (a job scheduler's, ``kill``'s) raises SystemExit; Ctrl-C raises
    KeyboardInterrupt: either way the run's processes are ended before the script exits as it would have."""
    script = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "run_captured_cli.py"), "600",
                               *hanging_ranks(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True, preexec_fn=default_sigint)
    try:
        wait_for_ranks(tmp_path, script)
        script.send_signal(sig)
        _, stderr = script.communicate(timeout=30)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
    assert_all_ended(mark, tmp_path)
    assert script.returncode == code, stderr[-3000:]
    assert f"run_captured_cli: stopped {sys.executable} -m torch.distributed.run" in stderr
    assert f"({why}): ended 3 processes" in stderr, stderr[-3000:]


def test_a_runs_row_says_its_timeout_without_the_last_line_it_happened_to_print(mark, monkeypatch, capsys):
    """A run stopped at the timeout printed its last line for no reason of its own (bench_trl's row once read
    "ran past 150 s: warnings.warn("): the row names the timeout, and an error only if the run printed one."""
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    warns_then_waits = [sys.executable, "-c", "import sys, time; print('  warnings.warn(', file=sys.stderr, "
                        "flush=True); time.sleep(60)"]
    _, status = launch.run_or_mark("bench", "[w] run", warns_then_waits, 2)
    assert status == "ran past 2 s", status
    errs_then_waits = [sys.executable, "-c", "import sys, time; print('RuntimeError: stuck', file=sys.stderr, "
                       "flush=True); print('  warnings.warn(', file=sys.stderr, flush=True); time.sleep(60)"]
    assert launch.run_or_mark("bench", "[e] run", errs_then_waits, 2)[1] == "ran past 2 s: RuntimeError: stuck"
    exits = [sys.executable, "-c", "import sys; print('last words', file=sys.stderr); sys.exit(3)"]
    assert launch.run_or_mark("bench", "[x] run", exits, 30)[1] == "failed (3): last words"
    capsys.readouterr()
