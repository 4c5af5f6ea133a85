"""GPU behaviour of graphing/: capture, replay, parity with eager, failures, exit.

Run on the GPU machine: ``pytest -m gpu``. Skipped without CUDA; the two-rank tests
need two GPUs.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from conf.schema import compose
from graphing import CaptureError, GraphOptions, StepRole
from helpers.availability import cuda_count
from helpers.launches import launch
from helpers.wandb_offline import find_runs, read_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(cuda_count() < 2, reason="needs 2 GPUs")

SYNTH = ["recipe.data.source=synthetic", "recipe.data.train_size=16384", "recipe.data.test_size=2000"]


def in_session(overrides, tmp_path, job):
    """``job(trainer, logger)`` on a Trainer built in this process (one rank) by train.py's session,
    which then closes it; returns what the job returned."""
    from trainer.metrics.logger import MetricsLogger
    from trainer.session import Session

    cfg = compose([*SYNTH, "logger=none", f"output_root={tmp_path}", *overrides])
    out = []

    def train_job(session):
        trainer = session.build()
        quiet = MetricsLogger(cfg.logger, trainer.rt.run_dir, {}, rank=0, job_type="", enabled=False)
        out.append(job(trainer, quiet))
        return 0

    assert Session(cfg).execute(train_job) == 0
    return out[0]


def fit(overrides, tmp_path):
    def job(trainer, logger):
        summary = trainer.fit(logger)
        return list(trainer.history), summary, [p.detach().clone() for p in trainer.raw_model.parameters()]

    return in_session(overrides, tmp_path, job)


@two_gpus
@pytest.mark.parametrize("capture_error_mode", ["global", "thread_local", "relaxed"])
def test_each_capture_error_mode_trains_mnist_under_two_gpu_ddp(out, capture_error_mode):
    start = time.monotonic()
    done = launch([*SYNTH, "graph=full", f"graph.capture_error_mode={capture_error_mode}", "train.epochs=2",
                   "logger=none"], out, nproc=2, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    results = done.results()
    assert results["mode"] == "full" and results["timed_phase"] == "graph"
    assert results["graph/train_capture_s"] > 0 and results["graph/eval_capture_s"] > 0
    assert len(set(results["param_digests"])) == 1, results["param_digests"]
    assert results["final/eval_accuracy"] > 0.9
    assert time.monotonic() - start < 180, "a graphed 2-GPU run must exit promptly"


def test_full_graph_matches_eager_step_for_step(tmp_path):
    """Same seed, same data: per-step losses, the LR schedule and the parameters agree."""
    common = ["train.max_steps=60", "train.log_every=1", "train.eval=false",
              "recipe.schedule._target_=trainer.step.schedules.Cosine", "recipe.schedule.warmup_steps=10"]
    eager, _, eager_params = fit([*common, "graph=eager"], tmp_path / "eager")
    full, summary, full_params = fit([*common, "graph=full"], tmp_path / "full")
    assert summary["mode"] == "full" and summary["timed_phase"] == "graph"
    e_rows = [r for r in eager if "train/loss" in r]
    f_rows = [r for r in full if "train/loss" in r]
    assert len(e_rows) == len(f_rows) == 60
    # The LR written inside the graph from the device step counter equals the eager one.
    assert [r["train/lr"] for r in f_rows] == [r["train/lr"] for r in e_rows]
    assert f_rows[0]["train/lr"] < f_rows[20]["train/lr"]  # warm-up really happened
    loss_diff = max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(e_rows, f_rows))
    param_diff = max((a - b).abs().max().item() for a, b in zip(eager_params, full_params))
    print(f"parity over 60 steps: max |loss diff| {loss_diff:.3g}, max |param diff| {param_diff:.3g}")
    assert loss_diff < 1e-4 and param_diff < 1e-4


def test_dropout_in_a_captured_step_draws_new_masks_on_every_replay():
    x = torch.ones(4096, device="cuda")
    out = torch.empty_like(x)
    executor = _executor("fail")

    def step():
        out.copy_(F.dropout(x, 0.5))

    masks = []
    for _ in range(5):  # 2 warm-up steps, the capture (which also runs the step), 2 replays
        executor.run(StepRole.train, lambda: None, step)
        masks.append(out != 0)
    assert (StepRole.train, None) in executor.graphs
    assert not torch.equal(masks[2], masks[3]) and not torch.equal(masks[3], masks[4])
    assert 0.45 < masks[4].float().mean().item() < 0.55
    executor.close()


def test_eval_graph_equals_eager_evaluation(tmp_path):
    def job(trainer, logger):
        trainer.fit(logger)
        graphed = trainer.evaluate()
        assert (StepRole.eval, None) in trainer.executor.graphs
        graphed_again = trainer.evaluate()  # all batches replayed from the graph this time
        trainer.executor.eval_model.eval()
        trainer.eval_loader.start_epoch(0)
        trainer.eval_step.metrics.zero_()
        for _ in range(trainer.eval_loader.steps):
            trainer.eval_loader.stage()
            trainer.eval_step()  # plain eager
        loss_sum, correct, count = trainer.eval_step.metrics.tolist()
        assert count == 2000 and graphed["eval/samples"] == 2000
        assert graphed == graphed_again
        assert abs(graphed["eval/loss"] - loss_sum / count) < 1e-6
        assert graphed["eval/accuracy"] == correct / count

    in_session(["graph=full", "train.max_steps=30", "train.eval=false"], tmp_path, job)


@pytest.mark.parametrize("graph", ["partial", "compile", "full_compiled"])
def test_other_modes_train_and_agree_with_eager(out, graph):
    args = [*SYNTH, "train.epochs=2", "logger=none"]
    eager = launch([*args, "graph=eager", f"output_root={out}/eager"], out, timeout=300)
    other = launch([*args, f"graph={graph}", f"output_root={out}/{graph}"], out, timeout=300)
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert other.returncode == 0, other.stderr[-3000:]
    import json
    e = json.loads(next((out / "eager").rglob("results.json")).read_text())
    o = json.loads(next((out / graph).rglob("results.json")).read_text())
    # Dropout draws differ between modes (warm-up passes consume RNG), so agreement is statistical.
    assert abs(e["final/eval_accuracy"] - o["final/eval_accuracy"]) < 0.02, (e, o)
    assert o["final/eval_accuracy"] > 0.9


def _executor(on_failure: str, capture_error_mode: str = "global"):
    from graphing import build_executor

    options = GraphOptions(mode="full", warmup_iters=2, on_failure=on_failure, capture_error_mode=capture_error_mode)
    return build_executor(options, torch.device("cuda", 0))


def test_a_host_sync_in_the_step_fails_capture_with_an_explanation():
    x = torch.randn(256, device="cuda")
    seen = []
    executor = _executor("fail")
    step = lambda: seen.append(x.sum().item())  # noqa: E731  the planted host sync
    for _ in range(2):
        executor.run(StepRole.train, lambda: None, step)  # warm-up runs eagerly
    with pytest.raises(CaptureError) as err:
        executor.run(StepRole.train, lambda: None, step)
    message = str(err.value)
    assert "synchronizes with the host" in message and ".item()" in message
    assert "set on_failure=eager" in message  # graphing's own names; the trainer words them as graph.*
    assert "set graph.on_failure=eager" in err.value.render(lambda name: f"graph.{name}")
    executor.close()


def test_capture_failure_can_fall_back_to_eager():
    x = torch.randn(256, device="cuda")
    seen = []
    executor = _executor("eager")
    for _ in range(5):  # dropout draws random numbers after the failed capture too
        executor.run(StepRole.train, lambda: None, lambda: seen.append(F.dropout(x, 0.5).sum().item()))
    assert executor.report.fallback and executor.phase(StepRole.train) == "eager"
    assert len(seen) == 5  # 2 warm-up, the failed capture's eager rerun, 2 more eager steps
    executor.close()


def test_in_run_comparison_logs_both_sides_and_a_speedup(out):
    done = launch([*SYNTH, "experiment=compare", "graph.compare_steps=200", "train.epochs=2"], out, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = done.results()
    assert results["speedup"] > 1.0
    assert results["eager/steps_timed"] >= 200 and results["graph/steps_timed"] >= 200
    run = read_run(find_runs(done.run_dir)[0])
    assert run.summary["speedup"] == pytest.approx(results["speedup"])
    assert {"eager/samples_per_s", "graph/samples_per_s"} <= set(run.summary)
    assert "| eager |" in done.stdout and "| graph |" in done.stdout


# ---- capture_error_mode reaches every capture this project makes ----------------------

_pinned_sizes = itertools.count(20)
pinning_outcomes: list = []  # what each pinning thread saw: "ok", "refused" or "hung"


def _allocate_from_another_thread() -> None:
    """While this thread captures, another pins new host memory (cudaHostAlloc), as a
    DataLoader's pin-memory thread does: "global" mode forbids that, "thread_local" and
    "relaxed" allow it. Outside a capture it does nothing."""
    if not torch.cuda.is_current_stream_capturing():
        return
    size = 2 ** next(_pinned_sizes)  # a size never pinned before: the host cache cannot serve it

    def work():
        try:
            torch.empty(size, dtype=torch.uint8, pin_memory=True)
            pinning_outcomes.append("ok")
        except RuntimeError:
            pinning_outcomes.append("refused")  # the capturing thread reports what it did to the capture

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout=5)
    if worker.is_alive():
        pinning_outcomes.append("hung")
        raise RuntimeError("the pinning thread did not finish within 5 s")

@pytest.mark.parametrize("capture_error_mode", ["global", "thread_local", "relaxed"])
@pytest.mark.parametrize("role", [StepRole.train, StepRole.eval])
def test_capture_error_mode_reaches_the_training_and_eval_graphs(role, capture_error_mode):
    x = torch.randn(1024, device="cuda")
    out = torch.empty_like(x)
    executor = _executor("fail", capture_error_mode)

    def step():
        out.copy_(x * 2)
        _allocate_from_another_thread()

    try:
        while executor.phase(role) != "capture":
            executor.run(role, lambda: None, step)
        pinning_outcomes.clear()
        if capture_error_mode == "global":
            with pytest.raises(CaptureError, match="CUDA graph capture failed"):
                executor.run(role, lambda: None, step)
            assert pinning_outcomes == ["refused"]  # CUDA refused the other thread's call: the mode was in force
        else:
            executor.run(role, lambda: None, step)
            assert pinning_outcomes == ["ok"]
            assert (role, None) in executor.graphs and executor.report.capture_error_mode == capture_error_mode
            out.zero_()
            executor.run(role, lambda: None, step)  # a replay
            torch.testing.assert_close(out, x * 2)
    finally:
        executor.close()


@pytest.mark.parametrize("capture_error_mode", ["global", "thread_local"])
def test_capture_error_mode_reaches_partial_graphs_where_torch_accepts_it(capture_error_mode, caplog):
    from graphing import build_executor
    from graphing.compat import make_graphed_callables_takes_capture_error_mode

    class AllocatesFromAnotherThread(torch.nn.Linear):
        def forward(self, inputs):
            _allocate_from_another_thread()
            return super().forward(inputs)

    model = AllocatesFromAnotherThread(16, 16).cuda()
    options = GraphOptions(mode="partial", warmup_iters=2, capture_error_mode=capture_error_mode)
    executor = build_executor(options, torch.device("cuda", 0))
    passed_on = make_graphed_callables_takes_capture_error_mode()
    sample = (torch.randn(8, 16, device="cuda"),)
    pinning_outcomes.clear()
    with caplog.at_level(logging.WARNING, logger="graphing"):
        if capture_error_mode == "global" or not passed_on:
            with pytest.raises(CaptureError, match="CUDA graph capture failed"):  # explained, generator repaired
                executor.wrap_model(model, lambda: sample)
            assert pinning_outcomes[:1] == ["refused"]
        else:
            graphed = executor.wrap_model(model, lambda: sample)
            torch.testing.assert_close(graphed(sample[0]), model(sample[0]))
    assert executor.report.capture_error_mode == (capture_error_mode if passed_on else "global")
    ignored = [r for r in caplog.records if "is ignored in mode=partial" in r.getMessage()]
    assert len(ignored) == (1 if capture_error_mode != "global" and not passed_on else 0)
    print(f"torch {torch.__version__}: make_graphed_callables takes capture_error_mode: {passed_on}")
