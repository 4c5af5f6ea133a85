"""Sequence-length buckets (``recipe.data.seq_len_buckets``): a language model trains on
shorter sequences first, each length its own CUDA graph.

The buckets (the longest is the whole window, where the model is evaluated) split the
run's optimizer steps into equal, consecutive shares, shortest first:
``[128, 256, 1024]`` over 300 steps trains steps 1-100 on the first 128 tokens of each
window, 101-200 on 256, 201-300 on the whole 1024. Short sequences early is a known way to
speed up the start of training (cheaper steps while the model learns short-range structure).
A bucket is a static slice of the loaded windows inside the step (``x[:, :L]``, ``y[:, :L]``),
so every length is one fixed shape: one graph per bucket (and per tail step), up to
``graph.max_graphs``. The schedule is a function of the step alone, so a resumed run
continues in the same bucket.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from trainer.run.errors import ConfigError

SETTING = "recipe.data.seq_len_buckets"


class SeqLenSchedule:
    def __init__(self, buckets: Sequence[int], context: int, total_steps: int):
        self.buckets, self.context, self.total_steps = sorted(buckets), context, max(1, total_steps)

    def at(self, step: int) -> Optional[int]:
        """The sequence length of the step after ``step`` steps; None for the whole window."""
        length = self.buckets[min(len(self.buckets) - 1, step * len(self.buckets) // self.total_steps)]
        return None if length == self.context else length


def seq_len_schedule(buckets: Sequence[int], *, unit: str, context: int, total_steps: int, recipe: str,
                     shapes_per_bucket: int, max_graphs: int, graphed: bool) -> Optional[SeqLenSchedule]:
    """The schedule ``recipe.data.seq_len_buckets`` asks for (None: the whole window always), checked."""
    buckets: List[int] = list(buckets or [])
    if not buckets:
        return None
    if unit != "tokens":
        raise ConfigError(f"{SETTING}={buckets} applies to language models (sequences of tokens), but recipe "
                          f"{recipe!r} trains on {unit}: remove {SETTING}")
    wrong = [b for b in buckets if not isinstance(b, int) or b < 1 or b > context]
    if wrong or len(set(buckets)) != len(buckets):
        raise ConfigError(f"{SETTING}={buckets}: each bucket must be a distinct sequence length from 1 to the "
                          f"context, {context} tokens ({wrong or 'repeated lengths'}): fix {SETTING}")
    if max(buckets) != context:
        raise ConfigError(f"{SETTING}={buckets} must end at the whole window, {context} tokens (the model is "
                          f"evaluated there, and the headline numbers are its steps): add {context} to {SETTING}")
    if graphed and len(buckets) * shapes_per_bucket > max_graphs:
        raise ConfigError(f"{SETTING}={buckets} makes {len(buckets) * shapes_per_bucket} training step shapes "
                          f"({len(buckets)} lengths" + (", each with the epoch's last partial step" if
                                                        shapes_per_bucket > 1 else "")
                          + f"), one CUDA graph each, but graph.max_graphs={max_graphs}: raise graph.max_graphs, "
                          "use fewer buckets" + (", or set recipe.data.drop_last=true" if shapes_per_bucket > 1
                                                  else ""))
    return SeqLenSchedule(buckets, context, total_steps)


def truncate(batch, length: int):
    """The batch's windows cut to their first ``length`` tokens (inputs and targets alike)."""
    return {**batch, "x": batch["x"][:, :length], "y": batch["y"][:, :length]}
