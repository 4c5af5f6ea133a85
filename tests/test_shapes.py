"""The bookkeeping of graph.mode=full over several input shapes (graphing/shapes.py), on the
CPU: when each shape is captured, the bound on graphs, and the forwards DDP samples its stats on."""
from __future__ import annotations

import random

import pytest

from graphing.executor import StepRole
from graphing.options import DDP_STATS_EVERY, GraphConfigError, GraphOptions
from graphing.shapes import ShapeBook

pytestmark = pytest.mark.fast
TRAIN, EVAL = StepRole.train, StepRole.eval


def calls_until_capture(book: ShapeBook, role: StepRole, shape) -> int:
    """Calls at ``shape`` until the one that captures (included); the capture is then taken as made."""
    for n in range(1, 1000):
        book.meet(role, shape)
        if book.capture_now(role, shape):
            return n  # the caller now holds a graph for it and calls the book no more
    raise AssertionError("never captured")


def test_the_first_shape_waits_for_ddps_warm_up_and_later_shapes_for_their_own():
    book = ShapeBook(GraphOptions(warmup_iters=11, shape_warmup_iters=2), ddp=True)
    assert book.phase(TRAIN, "full") == "warmup"
    assert calls_until_capture(book, TRAIN, "full") == 12  # 11 eager, then the capture
    assert book.phase(TRAIN, "tail40") == "eager"  # past DDP's warm-up: a new shape's eager calls are "eager"
    assert calls_until_capture(book, TRAIN, "tail40") == 3
    assert calls_until_capture(book, EVAL, "eval") == 2  # one pass settles the kernels, then the capture
    assert book.known[TRAIN] == ["full", "tail40"]


@pytest.mark.parametrize("on_failure", ["fail", "eager"])
def test_a_shape_beyond_max_graphs_is_refused_naming_the_setting_or_runs_eagerly(on_failure):
    book = ShapeBook(GraphOptions(warmup_iters=1, max_graphs=2, on_failure=on_failure), ddp=False)
    for shape in ("a", "b"):
        calls_until_capture(book, TRAIN, shape)
    if on_failure == "fail":
        with pytest.raises(GraphConfigError, match=r"3th input shape \(c\).*\{max_graphs\}|max_graphs=2") as err:
            book.meet(TRAIN, "c")
        assert "max_graphs" in err.value.render() and "on_failure=eager" in err.value.render()
        return
    assert book.meet(TRAIN, "c") is True and book.meet(TRAIN, "c") is False  # said once
    assert all(not book.capture_now(TRAIN, "c") for _ in range(20)) and book.phase(TRAIN, "c") == "eager"
    assert book.known[TRAIN] == ["a", "b"]


@pytest.mark.parametrize("ddp", [True, False])
def test_a_capture_never_falls_on_a_forward_where_ddp_samples_its_stats(ddp):
    # 99 warm-up calls put the first capture on DDP's 100th forward: under DDP it waits.
    book = ShapeBook(GraphOptions(warmup_iters=99), ddp=ddp)
    assert calls_until_capture(book, TRAIN, "full") == (102 if ddp else 100)


def test_shapes_in_random_order_are_each_captured_once_and_never_on_a_sampled_forward():
    rng = random.Random(0)
    book = ShapeBook(GraphOptions(warmup_iters=11, max_graphs=8, shape_warmup_iters=1), ddp=True)
    shapes = [f"b{n}" for n in range(8)]
    graphs, at = set(), []
    for _ in range(3000):
        shape = rng.choice(shapes)
        if shape in graphs:  # replays: DDP's Python forward does not run
            continue
        book.meet(TRAIN, shape)
        before = book.ddp_forwards
        if book.capture_now(TRAIN, shape):
            graphs.add(shape)
            at.append(before)
    assert graphs == set(shapes) and len(at) == 8
    assert all(f >= 11 and f % DDP_STATS_EVERY not in (0, DDP_STATS_EVERY - 1) for f in at), at
