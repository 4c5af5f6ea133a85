"""The stop agreement's own logic, in one process. Ctrl-C, SIGTERM and SIGKILL sent to real
launches are rows of tests/test_fault_table.py."""
from __future__ import annotations

import pytest


@pytest.mark.fast
def test_one_process_checks_its_own_flag_and_ranks_agree_on_a_spacing_in_seconds():
    from trainer.run.stop import StopAgreement

    class OneProcess:
        distributed = False

    agreement = StopAgreement(OneProcess())
    agreement.start(0)
    assert not agreement.should_stop(1)  # no SIGTERM yet, and no collective needed to know it


@pytest.mark.fast
def test_a_rank_stuck_holding_the_gil_after_sigterm_still_exits_and_says_where():
    """The SIGTERM deadline runs in Python; a main thread stuck in a C call that holds the GIL
    (here a regular expression that backtracks for minutes) starves it, and the second
    signal's handler too. faulthandler's watchdog needs no GIL: it prints every thread's stack
    and exits with 1."""
    import subprocess
    import sys
    import textwrap
    import time

    from helpers.paths import ROOT

    script = textwrap.dedent("""
        import os, re, signal, sys, time
        sys.path.insert(0, sys.argv[1])
        from trainer.run import stop
        stop.TERM_GRACE_S, stop.BACKSTOP_S = 0.5, 1.0
        assert stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        while not stop.stop_requested():
            time.sleep(0.01)
        time.sleep(0.1)
        re.match(r"(a+)+$", "a" * 34 + "b")  # minutes in C, holding the GIL
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    assert time.monotonic() - started < 30
    assert "most recent call first" in done.stderr and "<string>" in done.stderr  # where the main thread was
