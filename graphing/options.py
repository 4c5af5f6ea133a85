"""Checks on the ``graph`` config that need more than a type: done before any work."""
from __future__ import annotations

import torch

from recipes.runtime import ConfigError

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
DDP_MIN_WARMUP = 11  # DDP samples stats with host syncs and rebuilds buckets in its first 10 iterations
GRAPH_MODES = ("full", "partial", "compile")


def resolve_mode(cfg_graph, device: torch.device, world_size: int) -> str:
    """The mode this run uses ('auto' resolved), after validating the graph settings."""
    mode = cfg_graph.mode.value
    if cfg_graph.capture_error_mode not in CAPTURE_ERROR_MODES:
        raise ConfigError(f"graph.capture_error_mode={cfg_graph.capture_error_mode!r} is not valid: choose "
                          f"one of {', '.join(CAPTURE_ERROR_MODES)} (global is the safe default; thread_local "
                          "allows unsafe CUDA calls from other threads such as a pinned-memory loader)")
    if mode == "auto":
        mode = "full" if device.type == "cuda" else "eager"
    if mode in GRAPH_MODES and device.type != "cuda":
        why = "this machine has no usable CUDA GPU" if not torch.cuda.is_available() else "device=cpu was chosen"
        raise ConfigError(f"graph.mode={mode} needs a CUDA GPU but {why}: "
                          "set graph=eager (or graph=auto, which picks eager without a GPU)")
    if cfg_graph.compile_model and mode != "full":
        raise ConfigError(f"graph.compile_model=true applies to graph.mode=full, not {mode}: "
                          "set graph=full or graph.compile_model=false")
    if mode == "full" and world_size > 1 and cfg_graph.warmup_iters < DDP_MIN_WARMUP:
        raise ConfigError(
            f"graph.warmup_iters={cfg_graph.warmup_iters} is too few under DDP: DistributedDataParallel "
            f"runs host-synchronizing bookkeeping in its first 10 iterations and rebuilds its buckets, "
            f"which cannot happen inside a CUDA graph; set graph.warmup_iters={DDP_MIN_WARMUP} or more")
    if cfg_graph.warmup_iters < 1 and mode == "full":
        raise ConfigError("graph.warmup_iters must be at least 1 (cuBLAS/cuDNN and the optimizer state "
                          "must exist before capture): set graph.warmup_iters=11")
    if cfg_graph.compare and mode != "full":
        raise ConfigError(f"graph.compare=true times eager steps against full-graph steps, but graph.mode is "
                          f"{mode}: set graph=full (or drop graph.compare)")
    if cfg_graph.compare_steps < 1:
        raise ConfigError(f"graph.compare_steps={cfg_graph.compare_steps} must be at least 1")
    return mode
