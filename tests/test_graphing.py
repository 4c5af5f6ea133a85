"""graphing/ as a library, on the CPU: what a user with their own loop relies on before any GPU.

The GPU behaviour (capture, replay, parity, capture_error_mode) is in test_graphing_gpu.py
and test_own_loop.py.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import graphing
from conftest import ROOT
from graphing import GraphConfigError, GraphedStep, GraphOptions, graph_safe_optimizer_kwargs, optimizer_capture_problem


def test_importing_graphing_loads_no_trainer_recipe_or_config_code():
    # Its lazy parts too: the graphed step, the executors and the graph doctor.
    probe = ("import graphing, sys; graphing.GraphedStep; graphing.build_executor; graphing.diagnose; "
             "graphing.DoctorReport; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('recipes', 'trainer', 'conf', 'hydra', 'omegaconf', 'wandb')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.fast
def test_options_refuse_what_cannot_work_and_name_the_setting():
    with pytest.raises(GraphConfigError, match=r"capture_error_mode='sometimes' is not one of global, thread_local"):
        GraphOptions(capture_error_mode="sometimes")
    with pytest.raises(GraphConfigError) as err:  # a caller with its own names for the settings words it
        GraphOptions(mode="full").resolved("cpu", 1, cuda_available=False)
    assert re.match(r"graph\.mode=full needs a CUDA GPU.*set graph\.mode=eager", err.value.render(lambda s: f"graph.{s}"))
    assert str(err.value).startswith("mode=full needs a CUDA GPU")
    with pytest.raises(GraphConfigError, match=r"^mode=partial needs a CUDA GPU but the device is cpu"):
        GraphOptions(mode="partial").resolved("cpu", 1)
    with pytest.raises(GraphConfigError, match=r"compile_model=true applies to mode=full, not eager"):
        GraphOptions(mode="eager", compile_model=True).resolved("cpu", 1)
    with pytest.raises(GraphConfigError, match=r"warmup_iters=3 is too few under DDP"):
        GraphOptions(mode="full", warmup_iters=3).resolved("cuda", 2)
    assert GraphOptions(mode="auto").resolved("cpu", 4).mode is graphing.GraphMode.eager
    assert GraphOptions(mode=graphing.GraphMode.auto).resolved("cuda", 4).mode is graphing.GraphMode.full
    assert GraphOptions(capture_error_mode=graphing.CaptureErrorMode["relaxed"]).capture_error_mode == "relaxed"


@pytest.mark.fast
def test_graph_safe_optimizer_options_fill_in_only_what_the_caller_left_unset():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graph_safe_optimizer_kwargs(torch.optim.SGD, cuda, {}) == {"fused": True}
    assert graph_safe_optimizer_kwargs(torch.optim.AdamW, cuda, {}) == {"capturable": True, "fused": True}
    assert graph_safe_optimizer_kwargs(torch.optim.AdamW, cuda, {"foreach": True}) == {"capturable": True}
    assert graph_safe_optimizer_kwargs(torch.optim.RMSprop, cuda, {}) == {"capturable": True}
    assert graph_safe_optimizer_kwargs(torch.optim.AdamW, cpu, {}) == {"foreach": False}
    assert graph_safe_optimizer_kwargs(torch.optim.LBFGS, cuda, {}) == {}


@pytest.mark.fast
def test_optimizers_whose_step_a_graph_would_freeze_are_named():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_capture_problem(torch.optim.SGD(params, lr=0.1)) is None
    assert "capturable=False" in optimizer_capture_problem(torch.optim.AdamW(params, lr=0.1))
    assert "neither a capturable nor a fused" in optimizer_capture_problem(torch.optim.Adagrad(params, lr=0.1))

    class MyDeviceSideOptimizer(torch.optim.Optimizer):  # a user's own class: trusted, capture will tell
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    assert optimizer_capture_problem(MyDeviceSideOptimizer(params)) is None


@pytest.mark.fast
def test_graphed_step_runs_a_users_loop_eagerly_on_the_cpu_and_guards_its_inputs():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def train_step(module, x, y):
        calls.append(module)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    x = torch.randn(16, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])  # learnable: a linear target
    with pytest.raises(GraphConfigError, match="mode=full needs a CUDA GPU"):
        GraphedStep(train_step, model, optimizer, mode="full")
    step = GraphedStep(train_step, model, optimizer, mode="eager")
    losses = [step(x, y).item() for _ in range(20)]
    assert losses[-1] < losses[0] / 2 and step.phase == "eager" and step.report.mode == "eager"
    assert all(module is model for module in calls)  # no process group: the model itself, no DDP
    with pytest.raises(ValueError, match=r"argument 0 changed from \(16, 4\) torch.float32 to \(8, 4\)"):
        step(x[:8], y[:8])
    step.close()
    with pytest.raises(RuntimeError, match="closed"):
        step(x, y)


@pytest.mark.fast
def test_step_times_of_a_long_run_stay_bounded_with_median_and_p90_within_one_percent():
    import random
    import statistics

    from graphing.timing import StepTimes

    rng = random.Random(0)
    xs = [0.25 * rng.lognormvariate(0, 0.3) for _ in range(4 * StepTimes.EXACT_LIMIT)]  # ms, a long tail
    times, few = StepTimes(), StepTimes()
    for x in xs:
        times.add(x)
    for x in xs[:1000]:
        few.add(x)
    ordered = sorted(xs)
    exact_median, exact_p90 = statistics.median(ordered), ordered[int(round(0.9 * (len(ordered) - 1)))]
    summary = times.summary()
    assert times.stored < 1000  # a histogram now, not 40,000 numbers
    assert abs(summary["step_ms_median"] / exact_median - 1) < 0.01
    assert abs(summary["step_ms_p90"] / exact_p90 - 1) < 0.01
    assert summary["steps_timed"] == len(xs) and summary["step_ms_mean"] == pytest.approx(statistics.fmean(xs))
    assert few.summary()["step_ms_median"] == statistics.median(xs[:1000])  # below the limit: exact
