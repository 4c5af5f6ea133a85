"""The graph doctor: can this training step be captured, and would the captured step be right?

    report = graphing.diagnose(train_step, model, optimizer, (x, y))   # or a callable that makes inputs
    print(report)                                                       # the table, the verdict, the gain
    sys.exit(report.exit_code)                                          # 0 ready, 7 blocked, 6 captures-but-wrong

``step_fn(model, *inputs)`` is the step as ``GraphedStep`` takes it. The doctor runs it eagerly
for ``warmup_iters`` steps with its checks on (eager_checks.py gathers them: the torch calls the
step makes, its learning rate, its optimizers, the memory it keeps, what differs between steps,
float8 weight scales it sets after its forward),
then, on CUDA, tries a capture of one more step in isolation (capture_attempt.py), whose replays
it compares with eager steps, and measures how launch-bound the eager step is (step_timing.py).
A host sync or copy that the eager steps make and the trial capture does not (a library that skips
it while capturing) is a note, not a finding (capture_judgement.py). Every finding names the line
that causes it (the innermost frame outside torch: attribution.py), the line of the library it was
made in when the user's line called into one, and the fix.

It reports only what blocks a capture, or what captures without error and then replays a frozen
or wrong step, on the installed torch. Seen on torch 2.11 (H200), and so left out: autocast's
weight cache inside the step captures and replays exactly like eager (a cache that outlives the
step does not: reported); SyncBatchNorm skips its host sync while capturing (a two-rank capture
works; it is reported only on a torch whose SyncBatchNorm lacks that guard). Under a process
group every rank checks and all ranks get the merged report; DDP's own host syncs in its first
10 iterations are left out. A model sharded with FSDP2 (``fully_shard``) is checked as it is,
FSDP2's own calls left out, what its modules' forwards call judged as in one process.

Verdicts and exit codes: ``ready`` (0), ``blocked`` (7: a capture fails), ``captures-but-wrong``
(6: it captures, and replays a frozen or wrong step). Without CUDA the checks that need a GPU
are skipped and named in ``report.skipped``; the verdict is that of what could be checked.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch
import torch.distributed as dist

from graphing.doctor.capture_attempt import recommended_mode, try_captures
from graphing.doctor.capture_judgement import judge
from graphing.doctor.eager_checks import EagerChecks
from graphing.doctor.findings import BLOCKS, in_report_order
from graphing.doctor.outer_autocast import outer_autocast_site, report_outer_autocast
from graphing.doctor.ranks import laxest, merge_ranks
from graphing.doctor.report import COLUMNS, SKIPPED_WITHOUT_CUDA, DoctorReport, verdict_of
from graphing.doctor.step_runner import Inputs, StepRunner, on_side_stream
from graphing.doctor.step_timing import gpu_busy_ms, median_step_ms
from graphing.executor import distributed
from graphing.options import DDP_MIN_WARMUP, GraphOptions
from graphing.sharded import is_sharded

__all__ = ["COLUMNS", "SKIPPED_WITHOUT_CUDA", "DoctorReport", "diagnose"]


def diagnose(step_fn: Callable[..., Any], model: torch.nn.Module,
             optimizer: Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]] = None,
             inputs: Inputs = (), *, warmup_iters: int = DDP_MIN_WARMUP,
             ddp_kwargs: Optional[Dict[str, Any]] = None, device: Optional[torch.device] = None,
             stream: Optional["torch.cuda.Stream"] = None, timing_steps: int = 5,
             check_optimizer: bool = True, max_graphs: int = GraphOptions.max_graphs,
             replays: int = 3) -> DoctorReport:
    """Runs ``step_fn(model, *inputs)`` eagerly with checks, then (on CUDA) tries a capture; returns the report.

    ``inputs``: the example inputs of every step (a tuple), or a callable (or iterator) that makes
    each step's inputs, e.g. the next batch; it runs outside the step, like a loader. Tensors are
    copied into static device buffers first, as ``GraphedStep`` does. ``optimizer``: one or a
    list, judged as GraphedStep takes it (on CUDA also made graph-safe the way GraphedStep
    makes it), its ``lr`` watched. ``warmup_iters``: eager steps
    checked (11, what DDP needs before a capture). The capture is tried with
    ``capture_error_mode="global"``, then "thread_local" if another thread broke it: the report
    recommends the strictest that works. Under a process group ``model`` is wrapped in DDP
    (``ddp_kwargs``) unless it already is, or holds a module sharded with FSDP2's ``fully_shard``
    (which communicates itself: taken as it is, as GraphedStep takes it), on ``stream`` (a side
    stream is made when None), which also runs the steps and the capture.
    ``timing_steps``: unchecked steps timed for the expected gain (0: none).
    ``check_optimizer=False`` leaves the optimizer's capturability to the caller (the trainer
    builds it graph-safe on CUDA itself). ``max_graphs``: how many sets of input shapes may
    come (GraphedStep's bound: a graph per set); more is a finding. ``replays``: how many replays of the
    trial capture are compared with as many eager steps from the same state (0: none; each needs a
    copy of the model's and optimizers' state on the device).

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
    side = (stream or torch.cuda.Stream(device=device)) if cuda else None
    from torch.nn.parallel import DistributedDataParallel as DDP

    is_ddp = isinstance(model, DDP)
    if distributed() and not is_ddp and not is_sharded(model):  # FSDP2 communicates itself: no DDP around it
        model = on_side_stream(lambda: DDP(model, device_ids=[device.index] if cuda else None, **(ddp_kwargs or {})),
                               side)
        is_ddp = True
    runner = StepRunner(step_fn, model, inputs, device, side)
    checks = EagerChecks(model, device, optimizers, max_graphs)
    if check_optimizer:  # as handed over, before the checked steps make its state; on CUDA as GraphedStep takes it
        checks.optimizer_watch.prepare(apply=cuda)
    outer_autocast = outer_autocast_site(sys._getframe(1), device)
    steps = max(int(warmup_iters), 1)
    # DDP syncs with the host in its first 10 iterations (runtime stats, bucket rebuild), from its
    # C++ reducer too: CUDA's own sync detection only watches the steps after that.
    sync_watch_from = min(DDP_MIN_WARMUP - 1, steps - 1) if is_ddp else min(1, steps - 1)
    checks.start()
    previous_trace = sys.gettrace()
    try:
        for i in range(steps):
            tracer = checks.learning_rates.tracer if optimizers else previous_trace
            sys.settrace(tracer)  # who writes a Python-number lr
            try:
                args = runner.next_inputs()
                staged = runner.stage(args)
                checks.begin_step(i, args)
                if i == 0 and outer_autocast is not None:
                    report_outer_autocast(checks.findings, outer_autocast)
                with checks.watching(cuda_syncs=cuda and i >= sync_watch_from):
                    checks.learning_rates.inside_step = True
                    try:
                        runner.run(staged)
                    finally:
                        checks.learning_rates.inside_step = False
            finally:
                sys.settrace(previous_trace)
                checks.end_step()
            checks.memory.after_step()
    finally:
        checks.stop()
    checks.after_steps(step_fn, check_optimizer)

    eager_ms = median_step_ms(runner.run_next, timing_steps, device, side) if timing_steps > 0 else None
    busy_ms = gpu_busy_ms(runner.run_next, device) if cuda and timing_steps > 0 else None
    findings = in_report_order(checks.findings)
    mode, capture, notes = recommended_mode(), "skipped (needs CUDA)", []
    if cuda:
        trial = try_captures(runner, optimizers, replays, checks.calls.mutated_tensors())
        mode, capture = laxest([trial.mode, mode]), trial.summary  # a loader thread may be idle during one capture
        findings, notes = judge(findings, trial, checks.findings.seen_by_cuda)
        if trial.failure is not None and not any(f.effect == BLOCKS for f in findings):
            findings.insert(0, trial.failure)
    if checks.learning_rates.carried and "lr_frozen" not in [f.kind for f in findings]:
        notes.append("the lr changes between steps, set by the loop: GraphedStep carries it into the graph (copied "
                     "into the device tensor the step reads before every call)")
    if checks.optimizer_watch.made_safe:
        notes.append(("changed the optimizer as GraphedStep does: " if cuda else
                      "on CUDA GraphedStep changes the optimizer: ") + "; ".join(checks.optimizer_watch.made_safe))
    shapes = checks.records.input_shapes
    if 1 < len(shapes) <= max_graphs:
        notes.append(f"the inputs came in {len(shapes)} sets of shapes: GraphedStep captures one graph per set "
                     f"(up to max_graphs={max_graphs}), all in one memory pool")
    if is_ddp and steps < DDP_MIN_WARMUP:
        notes.append(f"only {steps} steps checked under DDP: its first {DDP_MIN_WARMUP - 1} iterations sync with the "
                     f"host, so a capture needs warmup_iters >= {DDP_MIN_WARMUP}")
    report = DoctorReport(findings, verdict_of(findings), mode, str(device),
                          dist.get_world_size() if distributed() else 1, steps, capture, eager_ms, busy_ms,
                          [] if cuda else list(SKIPPED_WITHOUT_CUDA), notes)
    for f in report.findings:
        f.ranks = [dist.get_rank() if distributed() else 0]
    return merge_ranks(report) if distributed() else report
