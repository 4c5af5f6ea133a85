"""graphing/ as a library, on the CPU: what a user with their own loop relies on before any GPU.

The GPU behaviour (capture, replay, parity, capture_error_mode) is in test_graphing_gpu.py
and test_own_loop.py.
"""
from __future__ import annotations

import linecache
import os
import re
import subprocess
import sys

import pytest
import torch

import graphing
from graphing import GraphConfigError, GraphedStep, GraphOptions, graph_safe_optimizer_kwargs, optimizer_capture_problem
from helpers.paths import ROOT


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
def test_dtensors_are_handled_in_one_module_of_graphing_that_the_others_call():
    # graphing/sharded.py answers every DTensor question (issue 48): no other module of graphing reaches into a
    # DTensor's layout or local tensor itself.
    dtensor_words = re.compile(r"\.(to_local|full_tensor|_local_tensor|placements|device_mesh)\b|\bDTensor\.|"
                               r"torch\.distributed\.tensor")
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in sorted((ROOT / "graphing").rglob("*.py"))
             if path.name != "sharded.py" for i, line in enumerate(path.read_text().splitlines(), 1)
             if dtensor_words.search(line.split("#")[0]) and not line.lstrip().startswith(("#", '"', "'"))]
    assert found == []
    assert len(dtensor_words.findall((ROOT / "graphing" / "sharded.py").read_text())) >= 4  # the words it looks for


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
    # Another shape is another set of static buffers (and on CUDA its own graph): the same step.
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model(x[:8]), y[:8]).item()
    assert step(x[:8], y[:8]).item() == pytest.approx(expected, rel=1e-6)
    assert set(step._slots) == {"16x4:float32,16x1:float32", "8x4:float32,8x1:float32"}

    def scaled_step(module, x, y, scale):
        return train_step(module, x, y) * scale

    scaled = GraphedStep(scaled_step, model, optimizer, mode="eager")
    scaled(x, y, 1.0)
    with pytest.raises(ValueError, match=r"argument 2 changed from 1.0 to 2.0"):
        scaled(x[:8], y[:8], 2.0)  # a new shape, and a Python value that a graph would have kept
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


def _linear_step(optimizer):
    def train_step(module, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return train_step


@pytest.mark.fast
def test_a_float_lr_written_between_calls_reaches_the_step_and_the_loop_keeps_seeing_its_own_value():
    from graphing.hyperparams import CarriedHyperparameters

    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    plain, carried = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    carried.load_state_dict(plain.state_dict())
    # foreach=False: the CPU's AdamW takes a tensor lr on that path
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=0.1, foreach=False)
    opt_carried = torch.optim.AdamW(carried.parameters(), lr=0.1, foreach=False)
    carry = CarriedHyperparameters(opt_carried, torch.device("cpu"))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt_carried, lambda t: 0.5 ** t)  # a torch scheduler's floats
    for t in range(6):
        lr = 0.1 * 0.5 ** t
        opt_plain.param_groups[0]["lr"] = lr
        carry.before_call()
        assert opt_carried.param_groups[0]["lr"] is carry.lrs[0]  # the one tensor a graph would read
        _linear_step(opt_carried)(carried, x, y)
        carry.after_call()
        _linear_step(opt_plain)(plain, x, y)
        assert opt_carried.param_groups[0]["lr"] == pytest.approx(lr)  # the loop sees the float it set
        assert carry.lrs[0].item() == pytest.approx(lr)
        schedule.step()  # writes the next float, between calls
    for a, b in zip(plain.parameters(), carried.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # float32 lr tensor against a Python float


@pytest.mark.fast
def test_a_step_that_sets_its_own_lr_or_a_hyperparameter_changed_after_capture_is_refused_by_name():
    from graphing.hyperparams import CarriedHyperparameters

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01, foreach=False)
    carry = CarriedHyperparameters(optimizer, torch.device("cpu"))
    carry.before_call()
    optimizer.param_groups[0]["lr"] = 0.3  # inside the step: a replay would never run this
    change = carry.after_call()
    assert change == "sets optimizer.param_groups[0]['lr'] (to 0.3)"
    with pytest.raises(GraphConfigError, match=r"train_step sets optimizer.param_groups\[0\]\['lr'\] \(to 0.3\) "
                                               r"inside the step.*set the lr, in your loop between calls"):
        raise carry.refusal("train_step", change, None)
    assert optimizer.param_groups[0]["lr"] == 0.1  # the loop's value is back
    carry.before_call()
    carry.after_call()
    carry.freeze_the_rest()  # captured: only lr may change from here on
    optimizer.param_groups[0]["lr"] = 0.05
    carry.before_call()  # fine: carried
    carry.after_call()
    optimizer.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(GraphConfigError, match=r"param_groups\[0\]\['weight_decay'\] changed from 0.01 to 0.1 after "
                                               r"the step was captured: the graph keeps 0.01 \(only 'lr' is carried"):
        carry.before_call()
    optimizer.param_groups[0]["weight_decay"] = 0.01
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(GraphConfigError, match="had 1 param groups at the first call and has 2 now"):
        carry.before_call()


@pytest.mark.fast
def test_a_scheduler_stepped_inside_the_step_is_refused_naming_its_line():
    # A torch scheduler fills the lr tensor in place: the capture would record that fill with the
    # value of the moment, and every replay would write it again (the lr frozen, silently).
    from graphing.hyperparams import CarriedHyperparameters

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    carry = CarriedHyperparameters(optimizer, torch.device("cpu"))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.5 ** t)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def train_step():
        _linear_step(optimizer)(model, x, y)
        schedule.step()  # the write a replay would never make
        return None

    carry.before_call()
    train_step()
    change = carry.after_call()
    assert change is not None and "writes into optimizer.param_groups[0]['lr'] in place" in change
    assert not isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)  # the loop's own float is back
    file, line = carry.line_of_change(train_step)
    assert os.path.samefile(file, __file__)
    assert "schedule.step()" in linecache.getline(file, line)
    message = str(carry.refusal("train_step", change, (file, line)))
    assert f"at {file}:{line}" in message and "Step the scheduler" in message
    carry.before_call()  # a step that leaves the lr alone passes
    _linear_step(optimizer)(model, x, y)
    assert carry.after_call() is None


@pytest.mark.fast
def test_one_cycle_cycling_momentum_is_refused_after_capture_naming_betas_and_the_setting():
    # Every Adam/AdamW path that captures reads betas on the host (checked on torch 2.11): the
    # cycled beta1 cannot reach a graph, so the first call after capture refuses it.
    from graphing.hyperparams import CarriedHyperparameters

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    carry = CarriedHyperparameters(optimizer, torch.device("cpu"))
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=8, cycle_momentum=True)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    carry.before_call()
    _linear_step(optimizer)(model, x, y)
    assert carry.after_call() is None
    carry.freeze_the_rest()  # as after capture
    cycle.step()  # between calls: the lr (carried) and beta1 (not) both move
    with pytest.raises(GraphConfigError, match=r"param_groups\[0\]\['betas'\] changed from \(0.95, 0.999\) to "
                                               r"\(0\.8\d+, 0.999\) after the step was captured.*read betas as host "
                                               r"numbers.*set cycle_momentum=False"):
        carry.before_call()
    cycle_without_momentum = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.AdamW(model.parameters(), lr=0.1), max_lr=0.1, total_steps=8, cycle_momentum=False)
    assert "max_momentum" not in cycle_without_momentum.optimizer.param_groups[0]  # the fix leaves betas alone


@pytest.mark.fast
def test_optimizers_are_made_graph_safe_before_their_first_step_or_refused_with_the_fix():
    from graphing.optimizers import make_graph_safe

    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw = torch.optim.AdamW(params, lr=0.1, fused=True)  # nanoGPT's: fused, no capturable
    assert "capturable=False" in optimizer_capture_problem(adamw)  # fused alone is refused by a capture
    assert make_graph_safe(adamw) == ["param_groups[0]: capturable=True"]
    assert optimizer_capture_problem(adamw) is None and adamw.defaults["capturable"]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert make_graph_safe(sgd, dry_run=True) == ["param_groups[0]: fused=True (SGD's other paths read a tensor lr "
                                                  "on the host)"]
    assert not sgd.param_groups[0]["fused"]  # a dry run changes nothing
    with pytest.raises(GraphConfigError, match=r"SGD was built with foreach=True.*build it with fused=True"):
        make_graph_safe(torch.optim.SGD(params, lr=0.1, foreach=True))
    stepped = torch.optim.Adam(params, lr=0.1)
    params[0].grad = torch.ones(2)
    stepped.step()
    with pytest.raises(GraphConfigError, match="has stepped already.*hand it over before its first step"):
        make_graph_safe(stepped)
    with pytest.raises(GraphConfigError, match="LBFGS.step needs a closure"):
        GraphedStep(lambda m: None, torch.nn.Linear(2, 1), torch.optim.LBFGS(params), mode="eager")


@pytest.mark.fast
def test_a_users_ddp_is_rewrapped_with_torchs_small_first_bucket_and_its_buffer_broadcast_setting():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from graphing.compat import ddp_buffer_sync_argument
    from graphing.ddp import unwrap_ddp
    from helpers.launches import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        defaults = DDP(torch.nn.Linear(4, 1))
        module, kwargs, _ = unwrap_ddp(defaults)
        assert "bucket_cap_mb" not in kwargs  # passed at all, any size would replace the small first bucket
        again = DDP(module, **kwargs)
        assert again.bucket_bytes_cap_default and again.bucket_bytes_cap == defaults.bucket_bytes_cap
        sized = DDP(torch.nn.Linear(4, 1), bucket_cap_mb=1)
        assert unwrap_ddp(sized)[1]["bucket_cap_mb"] == 1
        # The per-forward buffer broadcast, off, is carried under the name this torch's DDP takes
        sync_buffers = ddp_buffer_sync_argument()
        quiet = DDP(torch.nn.BatchNorm1d(4), **{sync_buffers: False})
        module, kwargs, _ = unwrap_ddp(quiet)
        assert kwargs[sync_buffers] is False and not DDP(module, **kwargs).will_sync_module_buffers()
        assert unwrap_ddp(defaults)[1][sync_buffers] is True
    finally:
        dist.destroy_process_group()


@pytest.mark.fast
def test_a_model_the_user_wrapped_in_ddp_is_rewrapped_once_with_its_settings():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers.launches import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        users = DDP(model, bucket_cap_mb=1, gradient_as_bucket_view=True)
        hooked = []

        def counting_hook(state, bucket):
            hooked.append(state)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        users.register_comm_hook("mine", counting_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step = GraphedStep(_linear_step(optimizer), users, optimizer, mode="eager")
        assert isinstance(step.model, DDP) and step.model is not users
        assert step.model.module is model and users.module is model  # not DDP(DDP(model)); the user's still works
        assert step.model.bucket_bytes_cap == users.bucket_bytes_cap and step.model.gradient_as_bucket_view
        x = torch.randn(16, 4)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        losses = [step(x, y).item() for _ in range(10)]
        assert losses[-1] < losses[0] / 2
        assert hooked and set(hooked) == {"mine"}  # the user's communication hook runs in the new wrapper
        # The user's wrapper handed over: its reducer (which held the gradient accumulators) is gone, and
        # calling it runs the new wrapper.
        assert "reducer" not in users.__dict__
        with torch.no_grad():
            torch.testing.assert_close(users(x), step.model(x))
        with pytest.raises(GraphConfigError, match=r"ddp_kwargs\['bucket_cap_mb'\]=25 differs from the DDP model's"):
            GraphedStep(_linear_step(optimizer), users, optimizer, mode="eager", ddp_kwargs={"bucket_cap_mb": 25})
        step.close()
    finally:
        dist.destroy_process_group()
