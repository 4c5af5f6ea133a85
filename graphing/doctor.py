"""The graph doctor: can this training step be captured, and would the captured step be right?

    report = graphing.diagnose(train_step, model, optimizer, (x, y))   # or a callable that makes inputs
    print(report)                                                       # the table, the verdict, the gain
    sys.exit(report.exit_code)                                          # 0 ready, 5 blocked, 6 captures-but-wrong

``step_fn(model, *inputs)`` is the step as ``GraphedStep`` takes it. The doctor runs it eagerly
for ``warmup_iters`` steps with its checks on (graphing/doctor_checks.py), then, on CUDA, tries a
capture of one more step in isolation and measures how launch-bound the eager step is. Every
finding names the line that causes it (the innermost frame outside torch) and the fix.

It reports only what blocks a capture, or what captures without error and then replays a frozen
or wrong step, on the installed torch. Seen on torch 2.11 (H200), and so left out: autocast's
weight cache inside the step captures and replays exactly like eager (a cache that outlives the
step does not: reported); SyncBatchNorm skips its host sync while capturing (a two-rank capture
works; it is reported only on a torch whose SyncBatchNorm lacks that guard). Under a process
group every rank checks and all ranks get the merged report; DDP's own host syncs in its first
10 iterations are left out.

Verdicts and exit codes: ``ready`` (0), ``blocked`` (5: a capture fails), ``captures-but-wrong``
(6: it captures, and replays a frozen or wrong step). Without CUDA the checks that need a GPU
are skipped and named in ``report.skipped``; the verdict is that of what could be checked.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import statistics
import sys
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from graphing.capture import leave_capture, explain_capture_failure, reset_rng_capture_state
from graphing.doctor_checks import (BLOCKS, WRONG, Checks, Finding, classify_file, enclosing_autocast_with,
                                    model_findings, optimizer_findings, user_site)
from graphing.executor import distributed
from graphing.optimizers import float_learning_rate, optimizer_capture_problem
from graphing.options import DDP_MIN_WARMUP

EXIT_READY, EXIT_BLOCKED, EXIT_WRONG = 0, 5, 6
VERDICT_EXIT = {"ready": EXIT_READY, "blocked": EXIT_BLOCKED, "captures-but-wrong": EXIT_WRONG}
COLUMNS = ["kind", "effect", "where", "what", "fix"]
SKIPPED_WITHOUT_CUDA = [
    "capture attempt (torch.cuda.graph)",
    "CUDA's own sync detection (torch.cuda.set_sync_debug_mode)",
    "device memory growth (torch.cuda.memory_allocated)",
    "GPU busy time per step (torch.profiler)",
]
PROFILE_STEPS = 3
_LAXNESS = ["global", "thread_local", "relaxed"]

Inputs = Union[Sequence[Any], Callable[[], Any]]


@dataclass
class DoctorReport:
    """What ``diagnose`` found; ``str(report)`` is the table a user reads."""

    findings: List[Finding]
    verdict: str  # "ready" | "blocked" | "captures-but-wrong"
    capture_error_mode: str  # the strictest mode that the step can be captured with (recommended)
    device: str
    world_size: int
    checked_steps: int
    capture: str  # what the capture attempt gave, or why there was none
    eager_step_ms: Optional[float] = None
    gpu_busy_ms: Optional[float] = None
    skipped: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return VERDICT_EXIT[self.verdict]

    @property
    def kinds(self) -> List[str]:
        return [f.kind for f in self.findings]

    def rows(self) -> List[List[Any]]:
        """One row per finding, in ``COLUMNS`` order (for W&B tables and CSV)."""
        return [[f.kind, f.effect, f.where, f.what, f.fix] for f in self.findings]

    @property
    def gpu_busy_fraction(self) -> Optional[float]:
        if self.eager_step_ms and self.gpu_busy_ms is not None:
            return self.gpu_busy_ms / self.eager_step_ms
        return None

    def gain(self) -> str:
        """The expected gain of a graph, in one line."""
        if self.eager_step_ms is None:
            return "not measured"
        eager = f"eager step {self.eager_step_ms:.2f} ms"
        if self.gpu_busy_ms is None:
            return f"{eager}; GPU busy time not measured (needs CUDA)"
        busy, fraction = self.gpu_busy_ms, self.gpu_busy_fraction
        text = f"{eager}, GPU busy {busy:.2f} ms per step ({100 * fraction:.0f}%)"
        if fraction < 0.8:
            speedup = self.eager_step_ms / max(busy, 1e-3)
            return f"{text}: launch-bound, a graph could bring the step toward {busy:.2f} ms (up to {speedup:.1f}x)"
        return f"{text}: GPU-bound, a graph saves at most {100 * (1 - fraction):.0f}% of the step"

    def table(self) -> str:
        head = (f"graph doctor: {self.checked_steps} eager steps checked on {self.device}"
                f"{f', {self.world_size} ranks' if self.world_size > 1 else ''}")
        lines = [head]
        if self.findings:
            width = [max(len(c), *(len(str(r[i])) for r in self.rows())) for i, c in enumerate(COLUMNS[:3])]
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(COLUMNS[:3], width)) + "  what -> fix")
            pad = " " * (2 + sum(width) + 2 * len(width))
            for row in self.rows():
                lines.append("  " + "  ".join(str(v).ljust(w) for v, w in zip(row[:3], width)) + "  " + row[3])
                lines.append(f"{pad}-> {row[4]}")
        else:
            lines.append("  no findings: nothing here blocks a capture or makes a captured step wrong")
        lines.append(f"verdict: {self.verdict} (exit {self.exit_code}) | recommended capture_error_mode: "
                     f"{self.capture_error_mode}")
        lines.append(f"expected gain: {self.gain()}")
        lines.append(f"capture: {self.capture}")
        if self.skipped:
            lines.append("skipped without CUDA: " + "; ".join(self.skipped))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["findings"] = [{**asdict(f), "where": f.where} for f in self.findings]
        out.update(exit_code=self.exit_code, gpu_busy_fraction=self.gpu_busy_fraction, expected_gain=self.gain())
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DoctorReport":
        names = {f for f in cls.__dataclass_fields__}
        findings = [Finding(**{k: v for k, v in f.items() if k != "where"}) for f in d["findings"]]
        return cls(**{**{k: v for k, v in d.items() if k in names}, "findings": findings})


def diagnose(step_fn: Callable[..., Any], model: torch.nn.Module,
             optimizer: Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]] = None,
             inputs: Inputs = (), *, warmup_iters: int = DDP_MIN_WARMUP,
             ddp_kwargs: Optional[Dict[str, Any]] = None, device: Optional[torch.device] = None,
             stream: Optional["torch.cuda.Stream"] = None, timing_steps: int = 5,
             check_optimizer: bool = True) -> DoctorReport:
    """Runs ``step_fn(model, *inputs)`` eagerly with checks, then (on CUDA) tries a capture; returns the report.

    ``inputs``: the example inputs of every step (a tuple), or a callable (or iterator) that makes
    each step's inputs, e.g. the next batch; it runs outside the step, like a loader. Tensors are
    copied into static device buffers first, as ``GraphedStep`` does. ``optimizer``: one or a
    list (checked for capturability, and its ``lr`` watched). ``warmup_iters``: eager steps
    checked (11, what DDP needs before a capture). The capture is tried with
    ``capture_error_mode="global"``, then "thread_local" if another thread broke it: the report
    recommends the strictest that works. Under a process group ``model`` is wrapped in DDP
    (``ddp_kwargs``) unless it already is, on ``stream`` (a side stream is made when None),
    which also runs the steps and the capture.
    ``timing_steps``: unchecked steps timed for the expected gain (0: none).
    ``check_optimizer=False`` leaves the optimizer's capturability to the caller (the trainer
    builds it graph-safe on CUDA itself).

    The model and optimizer take real steps: diagnose a copy if their state matters.
    """
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    optimizers = [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) \
        else list(optimizer)
    produce = _producer(inputs)
    side = (stream or torch.cuda.Stream(device=device)) if cuda else None
    from torch.nn.parallel import DistributedDataParallel as DDP

    is_ddp = isinstance(model, DDP)
    if distributed() and not is_ddp:
        with _on(side):
            model = DDP(model, device_ids=[device.index] if cuda else None, **(ddp_kwargs or {}))
        is_ddp = True
    checks = Checks(device, optimizers)
    outer_autocast = _outer_autocast(sys._getframe(1), device)
    steps = max(int(warmup_iters), 1)
    # DDP syncs with the host in its first 10 iterations (runtime stats, bucket rebuild), from its
    # C++ reducer too: CUDA's own sync detection only watches the steps after that.
    sync_watch_from = min(DDP_MIN_WARMUP - 1, steps - 1) if is_ddp else min(1, steps - 1)
    memory: List[int] = []
    static: Optional[List[Any]] = None
    hooks = model_findings(model, checks)
    checks.start()
    previous_trace = sys.gettrace()
    try:
        for i in range(steps):
            sys.settrace(checks.tracer if optimizers else previous_trace)  # who writes a Python-number lr
            try:
                args = produce()
                static, staged = _stage(static, args, device)
                checks.begin_step(i, args)
                if i == 0 and outer_autocast is not None:
                    checks.add("autocast_cache", WRONG, *outer_autocast,
                               "autocast with its weight cache on is active when the step starts (entered outside "
                               "the step): casts cached before the capture are read by the graph, stale (and "
                               "freed when that autocast region ends)")
                with _on(side), _cuda_sync_watch(cuda and i >= sync_watch_from, checks), checks:
                    step_fn(model, *staged)
            finally:
                sys.settrace(previous_trace)
                checks.end_step()
            if cuda:
                torch.cuda.synchronize(device)
                memory.append(torch.cuda.memory_allocated(device))
    finally:
        checks.stop()
        for h in hooks:
            h.remove()
    checks.compare_steps()
    checks.kept_tensors()
    if cuda and "memory_growth" not in {f.kind for f in checks.found.values()} and _grows(memory):
        checks.add("memory_growth", WRONG, *_definition(step_fn),
                   f"allocated device memory grew in each of the last steps (to {memory[-1] / 2**20:.1f} MiB): "
                   "the step keeps something per step")
    if check_optimizer:
        optimizer_findings(optimizers, checks, optimizer_capture_problem)

    run_once = _unchecked_runner(step_fn, model, produce, device, side, lambda: static)
    eager_ms = _time_steps(run_once, timing_steps, device, side) if timing_steps > 0 else None
    busy_ms = _gpu_busy_ms(run_once, device) if cuda and timing_steps > 0 else None
    findings = sorted(checks.found.values(), key=lambda f: (f.effect != BLOCKS, f.step or 0, f.file, f.line))
    mode, capture = _recommended_mode(), "skipped (needs CUDA)"
    if cuda:
        captured_with, capture, failure = _try_captures(step_fn, model, optimizers, produce, device, side, static)
        mode = max(captured_with, mode, key=_LAXNESS.index)  # a loader thread may be idle during one capture
        if failure is not None and not any(f.effect == BLOCKS for f in findings):
            findings.insert(0, failure)
    notes = []
    if any(float_learning_rate(o) for o in optimizers) and "lr_frozen" not in [f.kind for f in findings]:
        notes.append("an optimizer's lr is a Python number: it did not change in these steps, but a graph would keep "
                     "its capture-time value if a schedule changed it later (use a device tensor lr)")
    if is_ddp and steps < DDP_MIN_WARMUP:
        notes.append(f"only {steps} steps checked under DDP: its first {DDP_MIN_WARMUP - 1} iterations sync with the "
                     f"host, so a capture needs warmup_iters >= {DDP_MIN_WARMUP}")
    report = DoctorReport(findings, _verdict(findings), mode, str(device),
                          dist.get_world_size() if distributed() else 1, steps, capture, eager_ms, busy_ms,
                          [] if cuda else list(SKIPPED_WITHOUT_CUDA), notes)
    for f in report.findings:
        f.ranks = [dist.get_rank() if distributed() else 0]
    return merge_ranks(report) if distributed() else report


def _verdict(findings: Sequence[Finding]) -> str:
    if any(f.effect == BLOCKS for f in findings):
        return "blocked"
    if any(f.effect == WRONG for f in findings):
        return "captures-but-wrong"
    return "ready"


def merge_ranks(report: DoctorReport) -> DoctorReport:
    """Every rank's report merged into one, on every rank (a collective: all ranks call it)."""
    gathered: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report.to_dict())
    reports = [DoctorReport.from_dict(d) for d in gathered]
    merged: Dict[Tuple[str, str, int], Finding] = {}
    for r in reports:
        for f in r.findings:
            if f.key in merged:
                merged[f.key].ranks = sorted(set(merged[f.key].ranks) | set(f.ranks))
            else:
                merged[f.key] = f
    findings = sorted(merged.values(), key=lambda f: (f.effect != BLOCKS, f.step or 0, f.file, f.line))
    first = reports[0]
    failed = next((r.capture for r in reports if r.capture.startswith("failed")), first.capture)
    modes = [r.capture_error_mode for r in reports]
    eager = [r.eager_step_ms for r in reports if r.eager_step_ms is not None]
    notes = list(dict.fromkeys(n for r in reports for n in r.notes))
    return DoctorReport(findings, _verdict(findings), max(modes, key=_LAXNESS.index), first.device, first.world_size,
                        first.checked_steps, failed, max(eager) if eager else None, first.gpu_busy_ms,
                        first.skipped, notes)


# ---- running steps -----------------------------------------------------------------------------

def _producer(inputs: Inputs) -> Callable[[], Tuple[Any, ...]]:
    if hasattr(inputs, "__next__"):
        make = lambda: next(inputs)  # noqa: E731
    elif callable(inputs):
        make = inputs
    else:
        fixed = inputs
        make = lambda: fixed  # noqa: E731

    def produce() -> Tuple[Any, ...]:
        out = make()
        if out is None:
            return ()
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return produce


def _stage(static: Optional[List[Any]], args: Sequence[Any], device: torch.device):
    """Copies tensor inputs into static device buffers, as GraphedStep does: (buffers, what the step gets)."""
    if static is None:
        static = [torch.empty_like(x, device=device) if isinstance(x, torch.Tensor) else x for x in args]
    staged = []
    for k, x in enumerate(args):
        buffer = static[k] if k < len(static) else None
        if isinstance(x, torch.Tensor) and isinstance(buffer, torch.Tensor) and buffer.shape == x.shape \
                and buffer.dtype == x.dtype:
            buffer.copy_(x, non_blocking=True)
            staged.append(buffer)
        else:  # a changed shape cannot go through the buffers: the doctor reports it, the step still runs
            staged.append(x.to(device) if isinstance(x, torch.Tensor) else x)
    return static, staged


@contextlib.contextmanager
def _on(side):
    """Runs the block on the side stream (CUDA), ordered after and before the current stream's work."""
    if side is None:
        yield
        return
    current = torch.cuda.current_stream(side.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


@contextlib.contextmanager
def _cuda_sync_watch(on: bool, checks: Checks):
    """CUDA's own sync detection: catches host syncs made inside C++ ops that no Python call shows."""
    if not on:
        yield
        return
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return original(message, category, filename, lineno, file, line)
        frame, tag = user_site(sys._getframe(1))
        if frame is None or tag == "ignore":
            return None
        if checks.in_backward and (checks.ddp_syncs_in_backward or any(f.effect == BLOCKS for f in
                                                                         checks.found.values())):
            return None  # a gradient's sync (a boolean mask's, DDP's unused-parameter map): its cause is named
        place = (os.path.abspath(frame.f_code.co_filename), frame.f_lineno)
        if any((f.file, f.line) == place for f in checks.found.values()):
            return None  # already named by the Python-level check, with more detail
        kind = "grad_scaler" if tag == "scaler" else "host_sync"
        what = ("the backward pass synchronizes with the host here (the gradient of an op above)" if checks.in_backward
                else "a CUDA operation here synchronizes with the host")
        checks.add(kind, BLOCKS, *place, what + " (torch.cuda.set_sync_debug_mode)")

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
        warnings.showwarning = show
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _unchecked_runner(step_fn, model, produce, device, side, buffers) -> Callable[[], None]:
    def run() -> None:
        _, staged = _stage(buffers(), produce(), device)
        with _on(side):
            step_fn(model, *staged)
    return run


def _time_steps(run: Callable[[], None], count: int, device: torch.device, side) -> float:
    """Median eager step time in ms (CUDA events on the side stream, or the host clock)."""
    times = []
    for _ in range(count):
        if side is not None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(torch.cuda.current_stream(device))
            run()
            end.record(torch.cuda.current_stream(device))
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _gpu_busy_ms(run: Callable[[], None], device: torch.device) -> Optional[float]:
    """Summed kernel and copy time per step, from a short torch.profiler profile."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_STEPS):
                run()
            torch.cuda.synchronize(device)
        busy_us = sum(e.device_time for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # a profiler that cannot start (another one running) leaves the gain unmeasured
        return None
    return busy_us / 1e3 / PROFILE_STEPS


def _grows(memory: Sequence[int]) -> bool:
    tail = list(memory[-4:])
    return len(tail) == 4 and all(b > a for a, b in zip(tail, tail[1:]))


def _definition(fn) -> Tuple[str, int]:
    try:
        return os.path.abspath(inspect.getsourcefile(fn)), fn.__code__.co_firstlineno
    except (TypeError, AttributeError):
        return "", 0


def _outer_autocast(frame, device: torch.device) -> Optional[Tuple[str, int]]:
    """Where an autocast with its cache on was entered around the doctor's caller, if one is active."""
    if not (torch.is_autocast_enabled(device.type) and torch.is_autocast_cache_enabled()):
        return None
    first = None
    while frame is not None:
        if classify_file(frame.f_code.co_filename)[0] == "user":
            file = os.path.abspath(frame.f_code.co_filename)
            first = first or (file, frame.f_lineno)
            line = enclosing_autocast_with(file, frame.f_lineno)
            if line is not None:
                return file, line
        frame = frame.f_back
    return first or ("", 0)


# ---- the capture attempt (CUDA) -----------------------------------------------------------------

def _try_captures(step_fn, model, optimizers, produce, device, side, static):
    """(the mode it captured with, what happened, a capture_failed finding or None)."""
    failure = None
    for mode in ("global", "thread_local"):
        err, seconds = _capture_once(step_fn, model, optimizers, produce, device, side, static, mode)
        if err is None:
            return mode, f"captured in {seconds:.2f} s with capture_error_mode={mode}", None
        explanation = explain_capture_failure(err, mode)
        failure = failure or _capture_failed(err, explanation)
        low = explanation.lower()
        if "other thread" not in low and "invalidated" not in low:
            break  # the step itself is at fault: a laxer mode would not help
    return _recommended_mode(), f"failed: {explanation.splitlines()[0]}", failure


def _capture_once(step_fn, model, optimizers, produce, device, side, static, mode: str):
    if distributed():
        dist.barrier()
    _, staged = _stage(static, produce(), device)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)  # backward then allocates .grad in the graph's pool, as GraphedStep does
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    try:
        with torch.cuda.graph(graph, stream=side, capture_error_mode=mode):
            step_fn(model, *staged)
    except Exception as err:  # what the doctor is here to explain
        leave_capture(side)
        try:
            reset_rng_capture_state(side)
        except Exception:
            pass
        return err, time.perf_counter() - start
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    graph.reset()  # recorded, never replayed: the model is left as the eager steps left it
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)  # the captured backward's .grad were never computed
    return None, seconds


def _capture_failed(err: BaseException, explanation: str) -> Finding:
    file, line = "", 0
    for entry in reversed(traceback.extract_tb(err.__traceback__)):
        if classify_file(entry.filename)[0] == "user":
            file, line = os.path.abspath(entry.filename), entry.lineno or 0
            break
    cause = explanation.split("failed: ", 1)[-1].split("\n")[0]
    return Finding("capture_failed", BLOCKS, file, line, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}",
                   cause[:1].upper() + cause[1:])


def _recommended_mode() -> str:
    """thread_local when another thread may use CUDA during a capture (a pinned-memory loader), else global."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    return "thread_local" if any("pin_memory" in (t.name or "") for t in others) else "global"
