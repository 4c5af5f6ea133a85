"""SyncBatchNorm: ready on this torch.

Its host sync (a boolean mask over the ranks' counts) is skipped while a stream is capturing
on torch 2.11, and one process has no ranks to sync with. A two-rank capture was checked on
two H200s; the doctor reports SyncBatchNorm only on a torch whose forward lacks that guard.
"""
from __future__ import annotations

import torch.nn as nn

import torch

from . import Case, batches, mse_step, sgd


def build(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.SyncBatchNorm(16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    optimizer = sgd(model, device)

    return Case(mse_step(optimizer), model, optimizer, batches(device), verdict="ready", expect="matches")
