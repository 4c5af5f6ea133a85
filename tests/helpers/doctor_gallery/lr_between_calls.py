"""nanoGPT's schedule: the loop writes a Python-float lr into every param group before each call.
Carried into the graph by GraphedStep (no finding); the graphed steps match eager ones."""
from __future__ import annotations

import torch

from . import Case, batches, mse_step, small_model


def build(device):
    model, lrs = small_model(device), []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # as users write it: nothing for graphs
    next_batch = batches(device)

    def loop_inputs():  # the user's loop around the step: a schedule, then the next batch
        lrs.append(0.05 * 0.9 ** len(lrs))
        for group in optimizer.param_groups:
            group["lr"] = lrs[-1]
        return next_batch()

    # extra: the lr each group shows after the steps, as the loop wrote it (the graph must not replace it)
    return Case(mse_step(optimizer), model, optimizer, loop_inputs, verdict="ready", expect="matches",
                extra=lambda: [group["lr"] for group in optimizer.param_groups])
