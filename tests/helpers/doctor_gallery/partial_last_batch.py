"""The last batch of each round is partial: two shapes, each captured as a graph of its own."""
from __future__ import annotations

from . import Case, batches, mse_step, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)
    return Case(mse_step(optimizer), model, optimizer, batches(device, count=4, last=5), verdict="ready",
                expect="matches")
