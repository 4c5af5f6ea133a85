"""One executor per mode, chosen from resolved ``GraphOptions``."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from graphing.compiled import CompiledExecutor
from graphing.executor import Executor
from graphing.full import FullGraphExecutor
from graphing.options import GraphMode, GraphOptions
from graphing.partial import PartialGraphExecutor

EXECUTORS = {
    GraphMode.eager: Executor,
    GraphMode.full: FullGraphExecutor,
    GraphMode.partial: PartialGraphExecutor,
    GraphMode.compile: CompiledExecutor,
}


def build_executor(options: GraphOptions, device: torch.device,
                   ddp_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Executor:
    """The executor for ``options.mode`` (resolve ``auto`` first: ``GraphOptions.resolved``).
    ``kwargs`` go to the executor (``on_fallback``, ``comm_hook``)."""
    if options.mode not in EXECUTORS:
        raise ValueError(f"mode={options.mode.value!r} is not resolved: call GraphOptions.resolved(...) first")
    return EXECUTORS[options.mode](options, device, ddp_kwargs, **kwargs)
