"""The graph doctor on CUDA: each gallery step is named with the right kind and line, and the
verdict agrees with what really happens when the same step runs through graphing.GraphedStep.

    blocked             -> GraphedStep fails (the capture, or its bound on input shapes: max_graphs)
    captures-but-wrong  -> it captures, and what it leaves (outputs, parameters, Python-side
                           records) differs from the same steps run eagerly
    ready               -> it captures and matches eager

Run on the GPU machine: ``pytest -m gpu tests/test_doctor_gpu.py -s`` (prints each case's time).
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import graphing
from helpers.availability import cuda_count
from helpers.doctor_gallery import CASES, load, marked, source
from helpers.launches import free_port, launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(cuda_count() < 2, reason="needs 2 GPUs")

STEPS = 24  # per run of a case: 11 warm-up, the capture, then replays (in two halves: see Case.around)
OUTCOME_OF_VERDICT = {"blocked": "fails", "captures-but-wrong": "differs", "ready": "matches"}


@pytest.fixture
def nccl_group():
    """A real one-rank NCCL process group: the step runs in DDP, as under torchrun."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def run_steps(name: str, mode: str):
    """The case's step run STEPS times through GraphedStep: (outputs, parameters, extra records)."""
    case = load(name, "cuda")
    step = graphing.GraphedStep(case.step, case.model, case.optimizer, mode=mode, ddp_kwargs=case.ddp_kwargs,
                                max_graphs=case.max_graphs)
    outputs = []

    def half():
        for _ in range(STEPS // 2):
            outputs.append(step(*case.inputs()).detach().float().clone())

    try:
        case.around(half)  # two regions of the user's loop (two epochs, say)
        case.around(half)
        torch.cuda.synchronize()
    finally:
        step.close()
    return outputs, [p.detach().float().clone() for p in case.model.parameters()], case.extra()


def graphed_step_outcome(name: str) -> str:
    eager = run_steps(name, "eager")
    try:
        graphed = run_steps(name, "full")
    except Exception as err:  # CaptureError, or GraphConfigError (more input shapes than max_graphs)
        print(f"  GraphedStep: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return "fails"
    outputs_equal = len(eager[0]) == len(graphed[0]) and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(eager[0], graphed[0]))
    params_equal = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(eager[1], graphed[1]))
    extra_equal = len(eager[2]) == len(graphed[2]) and all(
        abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(eager[2], graphed[2]))
    return "matches" if outputs_equal and params_equal and extra_equal else "differs"


@pytest.mark.parametrize("name", CASES)
def test_each_gallery_step_on_cuda_doctor_names_it_and_agrees_with_graphed_step(name, request):
    began = time.monotonic()
    case = load(name, "cuda")
    if case.needs_process_group:
        request.getfixturevalue("nccl_group")
    report = case.around(lambda: graphing.diagnose(case.step, case.model, case.optimizer, case.inputs,
                                                   ddp_kwargs=case.ddp_kwargs, max_graphs=case.max_graphs))
    diagnosed = time.monotonic() - began
    found = {(f.kind, f.file, f.line) for f in report.findings}
    expected = {(kind, source(name), line) for kind, lines in marked(name).items() for line in lines}
    assert found == expected, report.table()
    assert report.verdict == case.verdict, report.table()
    assert report.eager_step_ms > 0 and report.gpu_busy_ms > 0, report.table()
    if report.verdict != "blocked":
        assert report.capture.startswith("captured"), report.table()
    outcome = graphed_step_outcome(name)
    print(f"{name}: doctor {report.verdict} in {diagnosed:.1f} s; GraphedStep {outcome}; "
          f"{time.monotonic() - began:.1f} s in all")
    assert outcome == case.expect
    assert OUTCOME_OF_VERDICT[report.verdict] == outcome


SMALL = {
    "mnist": ["recipe=mnist", "recipe.data.train_size=4096", "recipe.data.test_size=256"],
    "cifar10_resnet18": ["recipe=cifar10_resnet18", "recipe.data.batch_size=32", "recipe.data.train_size=2048",
                         "recipe.data.test_size=128"],
    "gpt_tiny": ["recipe=gpt_tiny", "recipe.model.n_layer=2", "recipe.model.n_head=4", "recipe.model.d_model=128",
                 "recipe.model.context=64", "recipe.data.train_size=1024", "recipe.data.test_size=64"],
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", sorted(SMALL))
def test_the_built_in_recipes_are_ready_and_capture_on_cuda(recipe, precision, tmp_path, capsys):
    from scripts.doctor import main

    began = time.monotonic()
    code = main([*SMALL[recipe], "recipe.data.source=synthetic", f"train.precision={precision}", "logger=none",
                 f"output_root={tmp_path}"])
    out = capsys.readouterr().out
    [path] = tmp_path.rglob("doctor.json")
    report = json.loads(path.read_text())
    with capsys.disabled():
        print(f"\n{recipe} {precision}: {report['verdict']}, {report['expected_gain']} "
              f"({time.monotonic() - began:.1f} s)")
    assert code == 0, out
    assert report["verdict"] == "ready" and report["findings"] == [], out
    assert report["capture"].startswith("captured") and report["skipped"] == []
    assert report["eager_step_ms"] > 0 and report["gpu_busy_ms"] > 0


def test_a_recipes_host_sync_is_named_on_cuda(tmp_path, capsys):
    from scripts.doctor import main

    code = main(["recipe._target_=helpers.doctor_gallery.broken_recipe.build", "recipe.name=broken",
                 "recipe.data.train_size=1024", "logger=none", f"output_root={tmp_path}"])
    out = capsys.readouterr().out
    [line] = marked("broken_recipe")["host_sync"]
    assert code == 7, out
    assert f"tests/helpers/doctor_gallery/broken_recipe.py:{line}" in out
    assert "capture: failed" in out  # the capture was tried, and failed as the table says


@two_gpus
def test_two_ranks_check_and_rank_0_prints_one_merged_report(tmp_path):
    began = time.monotonic()
    done = launch([*SMALL["mnist"], "recipe.data.source=synthetic", "logger=none", f"output_root={tmp_path}"],
                  script="scripts/doctor.py", nproc=2, timeout=300, log_dir=tmp_path / "logs",
                  env={"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    print(f"two-rank doctor: {time.monotonic() - began:.1f} s")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("graph doctor: 11 eager steps checked on cuda:0, 2 ranks") == 1, done.stdout
    [path] = tmp_path.rglob("doctor.json")
    report = json.loads(path.read_text())
    assert report["world_size"] == 2 and report["verdict"] == "ready" and report["capture"].startswith("captured")


@pytest.mark.parametrize("package", ["capture_aware_model", "syncing_model"])
def test_a_librarys_host_sync_is_judged_by_the_trial_capture(package, tmp_path):
    """A package that skips its sync while capturing: an eager-only note, ready, and GraphedStep captures it;
    one that syncs in every forward: blocked at the user's line and the package's, and GraphedStep fails."""
    from helpers import library_sync_loop as loop

    site = loop.write_package(tmp_path)
    try:
        report = loop.diagnose_loop(site, package, "cuda")
        step_fn, model, optimizer, inputs = loop.build(site, package, "cuda")
        step = graphing.GraphedStep(step_fn, model, optimizer)
        try:
            for _ in range(STEPS):
                step(*inputs)
            outcome = "captured" if step.report.graphs else "not captured"
        except graphing.CaptureError:
            outcome = "fails"
        finally:
            step.close()
    finally:
        sys.path.remove(str(site))
        sys.modules.pop(package, None)
    user_line = next(n for n, text in enumerate(open(loop.__file__).read().splitlines(), 1)
                     if "# doctor: host_sync" in text)
    where = f"tests/helpers/library_sync_loop.py:{user_line} -> {package}/__init__.py:{loop.package_sync_line()}"
    print(f"{package}: doctor {report.verdict}; GraphedStep {outcome}\n{report.table()}")
    if package == "capture_aware_model":
        assert report.verdict == "ready" and outcome == "captured", report.table()
        assert any(n.startswith(f"eager only; not in the graph: host_sync at {where}") for n in report.notes), \
            report.notes
    else:
        assert report.verdict == "blocked" and outcome == "fails", report.table()
        [finding] = [f for f in report.findings if f.kind == "host_sync"]
        assert finding.where == where, report.table()
        assert "the trial capture made it too: look for a setting of syncing_model" in finding.fix

