"""The stop agreement's own logic, in one process. Ctrl-C, SIGTERM and SIGKILL sent to real
launches are rows of tests/test_fault_table.py."""
from __future__ import annotations

import pytest


@pytest.mark.fast
def test_one_process_checks_its_own_flag_and_ranks_agree_on_a_spacing_in_seconds():
    from trainer.stop import StopAgreement

    class OneProcess:
        distributed = False

    agreement = StopAgreement(OneProcess())
    agreement.start(0)
    assert not agreement.should_stop(1)  # no SIGTERM yet, and no collective needed to know it
