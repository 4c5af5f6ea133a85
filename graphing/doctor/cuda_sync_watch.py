"""CUDA's own sync detection (``torch.cuda.set_sync_debug_mode``): catches host syncs made inside
C++ ops that no Python call shows, e.g. in a gradient's backward."""
from __future__ import annotations

import contextlib
import sys
import warnings

import torch

from graphing.doctor.attribution import call_site
from graphing.doctor.findings import BLOCKS, Findings, place_of
from graphing.doctor.interception import CallInterceptor


@contextlib.contextmanager
def watch_cuda_syncs(findings: Findings, calls: CallInterceptor, ddp_syncs_in_backward: bool):
    """Names each sync CUDA warns about in the block at its user line, unless its cause is named already."""
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return original(message, category, filename, lineno, file, line)
        site = call_site(sys._getframe(1))
        if (site.user is None and site.library is None) or site.tag == "ignore":
            return None
        if calls.in_backward and (ddp_syncs_in_backward or findings.any_blocking()):
            return None  # a gradient's sync (a boolean mask's, DDP's unused-parameter map): its cause is named
        if (*place_of(site.user), *place_of(site.library)) in findings.sites():
            return None  # already named by the Python-level check, with more detail
        kind = "grad_scaler" if site.tag == "scaler" else "host_sync"
        what = ("the backward pass synchronizes with the host here (the gradient of an op above)" if calls.in_backward
                else "a CUDA operation here synchronizes with the host")
        added = findings.add_at_site(kind, BLOCKS, site, what + " (torch.cuda.set_sync_debug_mode)")
        if added is not None:
            findings.seen_by_cuda.add(added.key)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
        warnings.showwarning = show
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
