"""A model the user already wrapped in DistributedDataParallel.

DDP must be built on the stream that warms up and captures the step (PyTorch's CUDA
graph notes), and wrapping a DDP model again would all-reduce twice. So a step that
is handed a DDP model is given its ``module`` and the wrapper's settings, and builds
its own DDP with them where it should.

The user's wrapper hands over: its reducer is released (``release_reducer``) before the new
DDP is built, because it keeps the parameters' gradient accumulators alive, and those remember
the stream they were made on (the default stream): a backward captured on the side stream would
then wait on the default stream, which a capture refuses. Its ``forward`` then goes through the
new wrapper (``forward_through``), so the user's references keep working: ``module`` is the same
object (parameters, ``state_dict``), and calling the old wrapper runs the new one.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from graphing.compat import ddp_buffer_sync_argument
from graphing.options import GraphConfigError, literal


def unwrap_ddp(model: torch.nn.Module) -> Tuple[torch.nn.Module, Dict[str, Any], List[Tuple[Callable, Any]]]:
    """(the module inside, the DDP keyword arguments it was built with, its communication hooks as
    (hook, state)); for a model that is no DDP: (model, {}, [])."""
    if not isinstance(model, DDP):
        return model, {}, []
    if isinstance(model.module, DDP):
        raise GraphConfigError("the model is DDP inside DDP: pass the module wrapped once (or not at all)")
    accepted = inspect.signature(DDP.__init__).parameters
    delayed = getattr(model, "_delay_all_reduce_params", None)
    if delayed:
        raise GraphConfigError(literal(
            "the DDP model was built with delay_all_reduce_named_params, which cannot be carried over to the "
            "DDP built for the graph: pass the unwrapped module with those settings in ddp_kwargs instead"))
    kwargs: Dict[str, Any] = {
        "device_ids": model.device_ids,
        "output_device": model.output_device,
        "dim": model.dim,
        "process_group": model.process_group,
        "find_unused_parameters": model.find_unused_parameters,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "static_graph": model.static_graph,
    }
    # Bucket sizes as the user gave them: none given, torch's default keeps a small first bucket
    # (the all-reduce starts early in backward), which any explicit size would replace.
    caps = getattr(model, "bucket_bytes_cap_list", None)
    if caps and "bucket_cap_mb_list" in accepted:
        kwargs["bucket_cap_mb_list"] = [cap / 2**20 for cap in caps]
    elif not getattr(model, "bucket_bytes_cap_default", False):
        kwargs["bucket_cap_mb"] = model.bucket_bytes_cap / 2**20
    # Buffer broadcasting before each forward, under the name this torch takes.
    sync_buffers = ddp_buffer_sync_argument()
    if hasattr(model, sync_buffers):
        kwargs[sync_buffers] = getattr(model, sync_buffers)
    if getattr(model, "mixed_precision", None) is not None:
        kwargs["mixed_precision"] = model.mixed_precision
    if getattr(model, "skip_all_reduce_unused_params", False):
        kwargs["skip_all_reduce_unused_params"] = True
    hooks = list(getattr(model, "_comm_hooks", []))
    if getattr(model, "mixed_precision", None) is not None:
        hooks = []  # DDP registers mixed precision's own hook when it is built
    return model.module, {k: v for k, v in kwargs.items() if k in accepted}, hooks


def merge_ddp_kwargs(taken: Dict[str, Any], given: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The wrapper's settings, with the caller's ``ddp_kwargs`` on top (a clash is refused, not guessed)."""
    given = dict(given or {})
    for key, value in given.items():
        if key in taken and taken[key] != value:
            raise GraphConfigError(literal(
                f"ddp_kwargs[{key!r}]={value!r} differs from the DDP model's own {key}={taken[key]!r}: pass either "
                "the unwrapped module with ddp_kwargs, or the DDP model without them"))
    return {**taken, **given}


def release_reducer(ddp: DDP) -> None:
    """Frees the wrapper's reducer (and the logger that shares it): its gradient accumulators go with it."""
    for name in ("logger", "reducer"):
        if name in ddp.__dict__:
            delattr(ddp, name)


def forward_through(old: DDP, new: torch.nn.Module) -> None:
    """Calls of the user's old wrapper run the new one."""
    old.forward = new.forward
