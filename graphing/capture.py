"""Capturing a callable into a CUDA graph, and saying in plain words why it failed."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Optional, Tuple, TypeVar

import torch

from graphing.options import SettingMessage, literal

T = TypeVar("T")


class CaptureError(SettingMessage, RuntimeError):
    """A capture failed on at least one rank; the message says why and what to change."""


# Held by the thread that captures, for as long as the capture lasts. Under capture_error_mode="global" (the
# default, and torch 2.11's make_graphed_callables' only mode) a CUDA call another thread makes meanwhile, even an
# event query, invalidates the capture: a thread that watches the device takes this lock first (outside_capture).
_CAPTURING = threading.Lock()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Around a capture this library makes: meanwhile other threads' ``outside_capture`` blocks are told to skip."""
    with _CAPTURING:
        yield


@contextlib.contextmanager
def outside_capture() -> Iterator[bool]:
    """For a thread other than the one that trains, around its CUDA calls (an event query, a memory reading):
    yields True when no capture is under way, and then holds any capture off until the block ends; False while
    one is under way: skip the calls this time (they would break the capture) and try again later. Never waits.

        with graphing.outside_capture() as free:
            if free:
                done = event.query()
    """
    free = _CAPTURING.acquire(blocking=False)
    try:
        yield free
    finally:
        if free:
            _CAPTURING.release()


def run_on_stream(fn: Callable[[], T], stream: torch.cuda.Stream) -> T:
    """``fn()`` on ``stream``, ordered after the current stream's work and before its next."""
    current = torch.cuda.current_stream(stream.device)  # the stream's device: the caller's may be another
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        result = fn()
    current.wait_stream(stream)
    return result


def explain_capture_failure(err: BaseException, capture_error_mode: str) -> str:
    """Turns CUDA's capture errors into a cause a user can act on: a message template
    (``CaptureError``'s) naming the settings as {capture_error_mode}, {on_failure}, {mode}."""
    text = f"{type(err).__name__}: {err}"
    chain = err.__context__ or err.__cause__
    if chain is not None:
        text += f" (after {type(chain).__name__}: {chain})"
    low = text.lower()
    if "generator not in capture mode" in low:
        # Measured on torch 2.11: torch.compile recomputes a checkpointed region's random draws (dropout) from
        # generators of its own (graph-safe RNG functionalization), which no capture outside its own cudagraphs
        # registers. A compiled checkpointed region without random draws captures (Llama, gpt_tiny at dropout 0).
        cause = ("a compiled region that is recomputed by activation checkpointing draws random numbers (dropout): "
                 "torch.compile keeps that recompute's random state in generators of its own, which this capture "
                 "does not hold. Set the model's dropout to 0, or train without compile inside the graph "
                 "(graph=full captures checkpointing and dropout), or train.activation_checkpointing=false")
    elif "operation not permitted when stream is capturing" in low or "capture" in low and "sync" in low \
            or "item()" in low or "cudaerrorstreamcaptureunsupported" in low:
        cause = ("the step synchronizes with the host while it is being captured, e.g. `.item()`, "
                 "`.cpu()`, `print(tensor)`, `bool(tensor)` in an `if`, or a tensor used as a Python number. "
                 "Keep values on the device inside the step (accumulate metrics in device tensors)")
        if capture_error_mode == "global":
            cause += (". If the call came from another thread (a pinned-memory loader thread), "
                      "{capture_error_mode}=thread_local tolerates it")
    elif ("invalidated" in low or "cudaerrorstreamcaptureimplicit" in low or "other thread" in low
          or "previous error during capture" in low):
        cause = ("a CUDA call from another thread (a pinned-memory DataLoader thread, the NCCL watchdog) "
                 "or an implicit sync on the legacy stream invalidated the capture")
        if capture_error_mode == "global":
            cause += "; {capture_error_mode}=thread_local tolerates calls from other threads"
    elif "capturable" in low:
        cause = ("the optimizer is not capture-safe: build it with capturable=True on CUDA (fused=True alone is "
                 "refused too; GraphedStep turns capturable on for an optimizer handed over before its first step); "
                 "graphing.graph_safe_optimizer_kwargs gives the arguments")
    elif "shape" in low or "size" in low and "mismatch" in low:
        cause = "the step's shapes changed between warm-up and capture; every batch must have the same shape"
    else:
        cause = "an operation in the step cannot be captured"
    return (f"CUDA graph capture failed: {cause}.\n  underlying error: {literal(text.strip()[:600])}\n"
            "  to try: fix the step, or set {on_failure}=eager to fall back to eager execution, "
            "or {mode}=eager")


def capture(fn: Callable[[], None], stream: torch.cuda.Stream, pool, capture_error_mode: str
            ) -> Tuple[Optional[torch.cuda.CUDAGraph], float, Optional[str]]:
    """Captures ``fn`` on ``stream``: (graph or None, seconds, failure explanation or None).

    The explanation is a ``CaptureError`` message template (see ``explain_capture_failure``)."""
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    try:
        with capturing(), torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            fn()
    except Exception as err:  # a failed capture is reported and agreed on, not fatal here
        leave_capture(stream)
        return None, time.perf_counter() - start, explain_capture_failure(err, capture_error_mode)
    torch.cuda.synchronize()
    return graph, time.perf_counter() - start, None


def leave_capture(stream: torch.cuda.Stream) -> None:
    """After a failed capture (``torch.cuda.graph`` has ended it), wait for the device to idle."""
    try:
        stream.synchronize()
        torch.cuda.synchronize()
    except Exception:
        pass


def reset_rng_capture_state(stream: torch.cuda.Stream) -> None:
    """Leaves the CUDA generator out of capture mode after a failed capture.

    A capture that fails ends before PyTorch closes the default generator's capture
    bookkeeping, and every later random op (dropout) then raises "Offset increment
    outside graph capture". One small successful capture opens and closes it again.
    """
    graph = torch.cuda.CUDAGraph()
    with capturing(), torch.cuda.graph(graph, stream=stream):
        torch.empty(1, device="cuda").fill_(0)
    del graph


def pool_mib(pool) -> float:
    """MiB reserved by a graph memory pool (from the allocator's snapshot)."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:
        return float("nan")
    total = sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool))
    return total / 2**20
