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
def test_ranks_check_at_the_step_after_an_evaluation_or_a_checkpoint_whatever_the_spacing():
    """The spacing comes from the step rate; an evaluation or a checkpoint between two checks is not in it, so
    after either the next step checks (``StopAgreement.soon``): a SIGTERM during a long evaluation is then agreed
    on one step later, not after the many steps a fast rate spaced."""
    import time

    import torch
    import torch.distributed as dist

    from trainer.run.stop import StopAgreement

    class Ranks:  # a process group of one stands in for the ranks: the agreement's all-reduce runs
        distributed, is_main, device = True, True, torch.device("cpu")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        agreement = StopAgreement(Ranks(), interval_s=60.0)
        agreement.start(0)
        time.sleep(0.01)
        assert not agreement.should_stop(1)  # the first check: about 100 steps a second, so ~6,000 steps apart
        assert agreement.next_check > 100
        agreement.soon(7)  # an evaluation (or a save) after step 7
        assert agreement.next_check == 8
        assert not agreement.should_stop(8)  # checked, and spaced again from the rate
        assert agreement.next_check > 8
        agreement.soon(9)
        agreement.soon(12)  # a second one before the check keeps the earlier step
        assert agreement.next_check == 10
    finally:
        dist.destroy_process_group()


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
