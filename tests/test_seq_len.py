"""Sequence-length buckets (trainer/step/seq_len.py), on the CPU: the schedule, the checks, and a
gpt_tiny run whose results give each bucket's throughput."""
from __future__ import annotations

import pytest

from trainer.run.errors import ConfigError
from trainer.step.seq_len import seq_len_schedule

pytestmark = pytest.mark.fast
OK = dict(unit="tokens", context=64, total_steps=30, recipe="gpt_tiny", shapes_per_bucket=2, max_graphs=8,
          graphed=True)


def test_buckets_take_equal_consecutive_shares_of_the_steps_shortest_first():
    schedule = seq_len_schedule([64, 16, 32], **OK)
    lengths = [schedule.at(step) for step in range(30)]
    assert lengths == [16] * 10 + [32] * 10 + [None] * 10  # None: the whole window
    assert seq_len_schedule([], **OK) is None


@pytest.mark.parametrize("buckets,overrides,needle", [
    ([16, 128], {}, "each bucket must be a distinct sequence length from 1 to the context, 64 tokens"),
    ([16, 16, 64], {}, "repeated lengths"),
    ([16, 32], {}, "must end at the whole window, 64 tokens"),
    ([8, 16, 32, 48, 64], {}, "makes 10 training step shapes (5 lengths, each with the epoch's last partial step), "
                              "one CUDA graph each, but graph.max_graphs=8"),
    ([16, 64], {"unit": "samples", "recipe": "mnist"}, "applies to language models"),
])
def test_buckets_that_cannot_work_are_refused_naming_the_setting(buckets, overrides, needle):
    with pytest.raises(ConfigError) as err:
        seq_len_schedule(buckets, **{**OK, **overrides})
    assert needle in str(err.value) and "recipe.data.seq_len_buckets" in str(err.value)


def test_eager_runs_are_not_bound_by_max_graphs():
    assert seq_len_schedule([8, 16, 32, 48, 64], **{**OK, "graphed": False}).at(29) is None


def test_a_gpt_run_over_three_buckets_reports_each_buckets_throughput(train_here):
    done = train_here(["recipe=gpt_tiny", "experiment=debug", "logger=none", "recipe.model.n_layer=1",
                       "recipe.model.d_model=32", "recipe.model.n_head=2", "recipe.model.context=32",
                       "recipe.data.train_size=256", "recipe.data.test_size=32", "recipe.data.batch_size=8",
                       "recipe.data.seq_len_buckets=[8,16,32]", "train.max_steps=36", "train.epochs=2",
                       "graph.warmup_iters=2"])
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["steps"] == 36
    for length in (8, 16):  # the whole window's steps are the headline: perf/tokens_per_s
        assert res[f"perf/bucket_T{length}/tokens_per_s"] > 0 and res[f"perf/bucket_T{length}/steps_timed"] > 0
    assert res["perf/tokens_per_s"] > 0
    rows = [r for r in done.metrics() if "train/loss" in r]
    assert rows and all(r["perf/tokens_per_s"] > 0 for r in rows)
