"""The model's own settings that sync with the host in every step: DDP built with
find_unused_parameters=True, and SyncBatchNorm on a torch that syncs while capturing."""
from __future__ import annotations

import sys
from typing import Any, List

import torch

from graphing.doctor.attribution import syncbn_syncs_while_capturing, user_site
from graphing.doctor.findings import BLOCKS, Findings


def ddp_finds_unused_parameters(model: torch.nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return isinstance(model, DDP) and model.find_unused_parameters


def watch_model(model: torch.nn.Module, findings: Findings) -> List[Any]:
    """Hooks that name each of these problems at the user line that calls the module; returns the hooks
    to remove after the steps."""
    handles = []

    def at_call(kind: str, what: str):
        def hook(module, args):
            frame, _ = user_site(sys._getframe(1))
            findings.add_at_frame(kind, BLOCKS, frame, what)
        return hook

    if ddp_finds_unused_parameters(model):
        handles.append(model.register_forward_pre_hook(at_call(
            "ddp_find_unused_parameters",
            "DDP built with find_unused_parameters=True copies its used-parameter map between host and device")))
    if syncbn_syncs_while_capturing() and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        for module in model.modules():
            if isinstance(module, torch.nn.SyncBatchNorm):
                handles.append(module.register_forward_pre_hook(at_call(
                    "sync_batchnorm", "SyncBatchNorm synchronizes with the host in its forward on this torch")))
                break
    return handles
