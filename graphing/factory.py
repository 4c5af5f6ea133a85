"""One executor per mode, chosen from resolved ``GraphOptions``."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from graphing.executor import Executor
from graphing.options import GraphOptions


def build_executor(options: GraphOptions, device: torch.device,
                   ddp_kwargs: Optional[Dict[str, Any]] = None) -> Executor:
    """The executor for ``options.mode`` (resolve ``auto`` first: ``GraphOptions.resolved``)."""
    if options.mode == "eager":
        return Executor(options, device, ddp_kwargs)
    if options.mode == "full":
        from graphing.whole_step import WholeStepGraphExecutor
        return WholeStepGraphExecutor(options, device, ddp_kwargs)
    if options.mode == "partial":
        from graphing.partial import PartialGraphExecutor
        return PartialGraphExecutor(options, device, ddp_kwargs)
    if options.mode == "compile":
        from graphing.compiled import CompiledExecutor
        return CompiledExecutor(options, device, ddp_kwargs)
    raise ValueError(f"mode={options.mode!r} is not resolved: call GraphOptions.resolved(...) first")
