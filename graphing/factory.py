"""One executor per mode, chosen from resolved ``GraphOptions``."""
from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

import torch

from graphing.executor import Executor
from graphing.options import GraphMode, GraphOptions

# Each mode's executor class, as "module:Class" (a mode's module loads only when it is used).
EXECUTORS = {
    GraphMode.eager: "graphing.executor:Executor",
    GraphMode.full: "graphing.whole_step:WholeStepGraphExecutor",
    GraphMode.partial: "graphing.partial:PartialGraphExecutor",
    GraphMode.compile: "graphing.compiled:CompiledExecutor",
}


def build_executor(options: GraphOptions, device: torch.device,
                   ddp_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Executor:
    """The executor for ``options.mode`` (resolve ``auto`` first: ``GraphOptions.resolved``).
    ``kwargs`` go to the executor (``on_fallback``, ``comm_hook``)."""
    if options.mode not in EXECUTORS:
        raise ValueError(f"mode={options.mode.value!r} is not resolved: call GraphOptions.resolved(...) first")
    module, name = EXECUTORS[options.mode].split(":")
    return getattr(importlib.import_module(module), name)(options, device, ddp_kwargs, **kwargs)
