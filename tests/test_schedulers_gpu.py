"""Torch lr schedulers with GraphedStep, the way loops use them: stepped between calls (carried into
the graph, training as eagerly), stepped inside the step function (refused at the first call, naming
the line: a capture would record the scheduler's in-place write once and every replay would repeat
that value), and OneCycleLR (its lr carried; cycling Adam's beta1, which every capturable Adam path
reads on the host, refused after capture naming the key and cycle_momentum).

Run on the GPU machine: ``pytest -m gpu tests/test_schedulers_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 24


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).cuda()


def _batches():
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(64, 32, device="cuda", generator=g), torch.randn(64, 1, device="cuda", generator=g))
            for _ in range(STEPS)]


def _step_fn(optimizer, schedule=None):
    def train_step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()  # inside the step: what a replay never runs
        return loss.detach()
    return train_step


def _train(model, optimizer, schedule, graphed: bool, **kwargs):
    """STEPS steps, the scheduler stepped between calls; each step's loss and lr, and the final parameters."""
    step = graphing.GraphedStep(_step_fn(optimizer), model, optimizer, warmup_iters=11, **kwargs) if graphed else None
    losses, lrs = [], []
    try:
        for x, y in _batches():
            lrs.append(optimizer.param_groups[0]["lr"])
            loss = step(x, y) if graphed else _step_fn(optimizer)(model, x, y)
            losses.append(loss.clone())
            schedule.step()
        phase = step.phase if graphed else "eager"
    finally:
        if step is not None:
            step.close()
    return torch.stack(losses).tolist(), lrs, [p.detach().clone() for p in model.parameters()], phase


def _assert_trains_alike(eager, graphed, rtol):
    (e_losses, e_lrs, e_params, _), (g_losses, g_lrs, g_params, phase) = eager, graphed
    assert phase == "graph"  # the last 12 calls replayed the graph
    assert g_lrs == e_lrs and max(e_lrs) / min(e_lrs) > 4  # the loop saw its own floats, and they moved
    for i, (a, b) in enumerate(zip(e_losses, g_losses)):
        assert b == pytest.approx(a, rel=rtol), f"step {i}: eager {a} graphed {b}"
    for a, b in zip(e_params, g_params):
        torch.testing.assert_close(b, a, rtol=rtol, atol=1e-5)  # a frozen lr moves them by percents


def test_a_scheduler_stepped_between_calls_trains_graphed_as_eagerly():
    runs = []
    for graphed in (False, True):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)  # nanoGPT's optimizer
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS, eta_min=3e-4)
        runs.append(_train(model, optimizer, schedule, graphed))
    _assert_trains_alike(*runs, rtol=1e-4)  # a float32 lr tensor against Python floats


def test_a_scheduler_stepped_inside_the_step_is_refused_at_the_first_call_naming_its_line():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    step = graphing.GraphedStep(_step_fn(optimizer, schedule), model, optimizer)
    line = next(n for n, text in enumerate(open(__file__), start=1) if "# inside the step: what" in text)
    x, y = _batches()[0]
    with pytest.raises(graphing.GraphConfigError) as err:
        step(x, y)
    message = str(err.value)
    assert "writes into optimizer.param_groups[0]['lr'] in place" in message
    assert f"test_schedulers_gpu.py:{line}" in message and "Step the scheduler" in message
    assert not step.report.graphs  # refused at the first call, long before a capture
    step.close()


@pytest.mark.parametrize("implementation", [{"fused": True}, {"foreach": True, "capturable": True}])
def test_one_cycle_cycling_beta1_is_refused_after_capture_naming_betas(implementation):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, **implementation)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=STEPS + 1, cycle_momentum=True)
    with pytest.raises(graphing.GraphConfigError, match=r"param_groups\[0\]\['betas'\] changed .* after the step "
                                                        r"was captured.*set cycle_momentum=False"):
        _train(model, optimizer, schedule, graphed=True)


def test_one_cycle_without_momentum_cycling_trains_graphed_as_eagerly():
    runs = []
    for graphed in (False, True):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=STEPS + 1,
                                                       cycle_momentum=False)
        runs.append(_train(model, optimizer, schedule, graphed))
    _assert_trains_alike(*runs, rtol=1e-4)
