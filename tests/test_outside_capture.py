"""graphing.outside_capture: how a thread other than the training one keeps its CUDA calls out of a capture
(a capture under capture_error_mode="global" breaks on any such call). The lock's behaviour, on the CPU; on a GPU,
tests/test_stall_gpu.py captures while the stall watchdog's thread looks."""
from __future__ import annotations

import threading

import pytest

from graphing import outside_capture
from graphing.capture import capturing

pytestmark = pytest.mark.fast


def test_outside_a_capture_the_block_is_free():
    with outside_capture() as free:
        assert free is True
    with outside_capture() as free:  # released: free again
        assert free is True


def test_while_another_thread_captures_the_block_is_told_to_skip_without_waiting():
    started, finish = threading.Event(), threading.Event()

    def capture_in_progress():
        with capturing():
            started.set()
            finish.wait(10)

    thread = threading.Thread(target=capture_in_progress)
    thread.start()
    try:
        assert started.wait(10)
        with outside_capture() as free:
            assert free is False
    finally:
        finish.set()
        thread.join(10)
    with outside_capture() as free:
        assert free is True


def test_a_capture_waits_for_a_block_already_inside():
    order = []
    inside, captured = threading.Event(), threading.Event()

    def capture():
        inside.wait(10)
        with capturing():
            order.append("capture")
        captured.set()

    thread = threading.Thread(target=capture)
    thread.start()
    with outside_capture() as free:
        assert free
        inside.set()
        assert not captured.wait(0.2)  # the capture cannot begin while the query runs
        order.append("query")
    assert captured.wait(10)
    thread.join(10)
    assert order == ["query", "capture"]
