"""The graph doctor on the CPU: what a user sees when they ask whether their step can be graphed.

Every gallery step (tests/helpers/doctor_gallery/) whose problem shows without CUDA is diagnosed with
the right kind at the line its marker comment names, and nothing else; the built-in recipes
are ready in every precision; scripts/doctor.py names a recipe's line, writes doctor.json and
logs the table to W&B (offline). tests/test_doctor_gpu.py checks the same gallery on CUDA
against what graphing.GraphedStep really does.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import graphing
from graphing.doctor import SKIPPED_WITHOUT_CUDA
from helpers.doctor_gallery import CASES, load, marked, source
from helpers.launches import free_port, launch
from helpers.paths import TESTS
from helpers.wandb_offline import find_runs, read_run

CPU_CASES = [name for name in CASES if not load(name, "cpu").needs_cuda]
CHECKED_STEPS = 5  # enough to compare steps (from the third on) and to see tensors kept from two steps


@pytest.fixture
def process_group():
    """A real one-rank gloo process group: diagnose wraps the model in DDP, as under torchrun."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def diagnose_case(name: str, device="cpu", **kwargs):
    case = load(name, device)
    kwargs = {"warmup_iters": CHECKED_STEPS, "timing_steps": 1, **kwargs}
    report = case.around(lambda: graphing.diagnose(case.step, case.model, case.optimizer, case.inputs,
                                                   ddp_kwargs=case.ddp_kwargs, max_graphs=case.max_graphs, **kwargs))
    return case, report


@pytest.mark.fast
@pytest.mark.parametrize("name", CPU_CASES)
def test_each_gallery_step_is_diagnosed_with_its_kind_at_the_marked_line(name, request):
    if load(name, "cpu").needs_process_group:
        request.getfixturevalue("process_group")
    case, report = diagnose_case(name)
    found = {(f.kind, f.file, f.line) for f in report.findings}
    expected = {(kind, source(name), line) for kind, lines in marked(name).items() for line in lines}
    assert found == expected, report.table()
    assert report.verdict == case.verdict, report.table()
    assert report.exit_code == {"ready": 0, "blocked": 7, "captures-but-wrong": 6}[case.verdict]
    for finding in report.findings:  # every finding says what it saw and the fix, in a sentence
        assert finding.what and finding.fix.endswith("."), finding


@pytest.mark.fast
def test_a_step_with_two_defects_gets_both_named_in_one_table():
    _, report = diagnose_case("two_defects")
    lines = marked("two_defects")
    table = report.table()
    assert f"tests/helpers/doctor_gallery/two_defects.py:{lines['host_sync'][0]}" in table
    assert f"tests/helpers/doctor_gallery/two_defects.py:{lines['lr_frozen'][0]}" in table
    assert "(0.05 then 0.025)" in table  # the lr the graph would freeze, as the user wrote it
    # Both block: the capture fails on the sync, and GraphedStep refuses an lr written inside the step.
    assert "verdict: blocked (exit 7)" in table and report.exit_code == 7
    assert [f.effect for f in report.findings] == ["blocks", "blocks"]  # GraphedStep refuses an lr set inside


@pytest.mark.fast
def test_without_cuda_the_report_names_the_checks_it_skipped():
    _, report = diagnose_case("clean")
    assert report.verdict == "ready" and report.findings == []
    assert report.skipped == SKIPPED_WITHOUT_CUDA
    table = report.table()
    assert "skipped without CUDA: capture attempt (torch.cuda.graph); CUDA's own sync detection" in table
    assert "capture: skipped (needs CUDA)" in table
    assert report.eager_step_ms > 0 and report.gpu_busy_ms is None


@pytest.mark.fast
def test_ddp_own_host_syncs_are_left_out(process_group):
    """Under a process group the step runs in DDP, whose early iterations sync from torch's own code."""
    _, report = diagnose_case("clean", warmup_iters=12)
    assert report.world_size == 1 and report.findings == [], report.table()
    assert report.verdict == "ready"


SMALL = {
    "mnist": ["recipe=mnist", "recipe.data.train_size=256", "recipe.data.test_size=64"],
    "cifar10_resnet18": ["recipe=cifar10_resnet18", "recipe.data.batch_size=2", "recipe.data.train_size=32",
                         "recipe.data.test_size=16", "graph.warmup_iters=6"],  # the full ResNet-18: fewer steps
    "gpt_tiny": ["recipe=gpt_tiny", "recipe.model.n_layer=1", "recipe.model.n_head=2", "recipe.model.d_model=32",
                 "recipe.model.context=16", "recipe.data.train_size=128", "recipe.data.test_size=16"],
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", sorted(SMALL))
def test_the_built_in_recipes_are_ready_in_every_precision(recipe, precision, tmp_path, capsys):
    from scripts.doctor import main

    code = main([*SMALL[recipe], "recipe.data.source=synthetic", f"train.precision={precision}", "logger=none",
                 f"output_root={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    [path] = tmp_path.rglob("doctor.json")
    report = json.loads(path.read_text())
    assert report["verdict"] == "ready" and report["findings"] == [], out
    steps = 6 if recipe == "cifar10_resnet18" else 11
    assert (report["recipe"], report["precision"], report["checked_steps"]) == (recipe, precision, steps)
    assert "no findings" in out and "verdict: ready (exit 0)" in out


def test_the_script_names_a_recipes_line_writes_doctor_json_and_logs_the_table_to_wandb(tmp_path, capsys, monkeypatch):
    """scripts/doctor.py's main, in this process, with the default (offline) W&B logger."""
    from scripts.doctor import main

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default: offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    code = main(["recipe._target_=helpers.doctor_gallery.broken_recipe.build", "recipe.name=broken",
                 "recipe.data.train_size=256", f"output_root={tmp_path}", "device=cpu"])
    done = capsys.readouterr()
    [line] = marked("broken_recipe")["host_sync"]
    where = f"tests/helpers/doctor_gallery/broken_recipe.py:{line}"
    assert code == 7, done.out + done.err[-3000:]
    assert where in done.out and "verdict: blocked (exit 7)" in done.out
    assert "skipped without CUDA: capture attempt" in done.out  # device=cpu: the GPU checks are named
    [path] = tmp_path.rglob("doctor.json")
    report = json.loads(path.read_text())
    assert report["verdict"] == "blocked" and report["exit_code"] == 7 and report["recipe"] == "broken"
    assert [(f["kind"], f["where"], f["effect"]) for f in report["findings"]] == [("host_sync", where, "blocks")]
    assert report["skipped"] == SKIPPED_WITHOUT_CUDA

    [run_file] = find_runs(path.parent)
    run = read_run(run_file)
    assert run.job_type == "doctor" and run.exit_code == 0
    assert run.summary["doctor/verdict"] == "blocked" and run.summary["doctor/finding_count"] == 1
    [row] = [r for r in run.history if r.get("doctor/findings/_type") == "table-file"]
    table = json.loads((run_file.parent / "files" / row["doctor/findings/path"]).read_text())
    assert table["columns"] == ["kind", "effect", "where", "what", "fix"]
    assert [r[:3] for r in table["data"]] == [["host_sync", "blocks", where]]


@pytest.mark.fast
def test_a_bad_setting_is_a_config_error_named_once(tmp_path, capsys):
    from scripts.doctor import main

    assert main(["train.grad_accum=0", "logger=none", f"output_root={tmp_path}"]) == 2
    assert capsys.readouterr().err.count("train.grad_accum=0 must be at least 1") == 1
    assert not list(tmp_path.rglob("doctor.json"))


@pytest.mark.fast
def test_torch_internal_calls_are_not_blamed_on_the_user_and_a_graph_safe_cpu_optimizer_is_not_blocked():
    """AdamW on the CPU, built with graph_safe_optimizer_kwargs, reads its host-side step counter with .item()
    inside torch.optim: not the user's sync."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    kwargs = graphing.graph_safe_optimizer_kwargs(torch.optim.AdamW, "cpu", {})  # foreach=False: a tensor lr on CPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), **kwargs)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    report = graphing.diagnose(step, model, optimizer, (torch.randn(8, 4), torch.randn(8, 1)), warmup_iters=4,
                               timing_steps=0)
    # Nothing at all: the sync is torch's own, and the optimizer (capturable=False, no state when handed
    # over) is one GraphedStep makes capturable itself: a correctly built CPU optimizer is not blocked.
    assert report.findings == [], report.table()
    assert report.verdict == "ready" and report.eager_step_ms is None


def test_under_torchrun_each_rank_checks_and_rank_0_prints_one_merged_report(tmp_path):
    """Two gloo ranks, the user's way: one table, one doctor.json, and torchrun's report names the verdict."""
    done = launch(["recipe._target_=helpers.doctor_gallery.broken_recipe.build", "recipe.name=broken",
                   "recipe.data.train_size=256", f"output_root={tmp_path}", "device=cpu", "logger=none"],
                  script="scripts/doctor.py", nproc=2, timeout=180, log_dir=tmp_path / "logs",
                  env={"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})
    [line] = marked("broken_recipe")["host_sync"]
    assert done.returncode != 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("verdict: blocked (exit 7)") == 1, done.stdout + done.stderr[-3000:]
    assert f"tests/helpers/doctor_gallery/broken_recipe.py:{line}" in done.stdout
    assert "graph doctor: blocked (exit 7)" in done.stderr  # torchrun's failure report says why
    [path] = tmp_path.rglob("doctor.json")
    report = json.loads(path.read_text())
    assert report["world_size"] == 2 and report["verdict"] == "blocked"


@pytest.mark.fast
def test_inputs_in_a_few_shapes_are_a_note_not_a_finding():
    case, report = diagnose_case("partial_last_batch")
    assert report.verdict == "ready" and not report.findings, report.table()
    assert any("the inputs came in 2 sets of shapes: GraphedStep captures one graph per set" in n
               for n in report.notes), report.notes


class _Holder:
    """An object in a reference cycle of its own: freed by the cycle collector only."""

    def __init__(self):
        self.me, self.kept = self, None


@pytest.mark.fast
def test_tensors_held_by_garbage_older_than_the_steps_are_not_said_to_be_kept():
    """The doctor collects the steps' cyclic garbage with the objects made before the steps frozen out (a full
    collection takes tenths of a second in a large process): a step's tensor held by such an older object, itself
    garbage, is collected by the full collection made before naming it, and no finding says the step keeps it.
    The process's own frozen objects stay frozen, and what the doctor froze is thawed."""
    import gc

    from helpers.doctor_gallery import batches, sgd, small_model

    model = small_model(torch.device("cpu"))
    optimizer = sgd(model, torch.device("cpu"))
    holders = [_Holder() for _ in range(CHECKED_STEPS)]  # made before the steps: frozen during them
    steps = iter(range(CHECKED_STEPS))

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        i = next(steps)
        holders[i].kept = loss.detach() * 1  # a tensor this line makes, each step
        holders[i] = None  # its holder now garbage: a cycle older than the steps
        return loss.detach()

    assert gc.get_freeze_count() == 0
    report = graphing.diagnose(step, model, optimizer, batches(torch.device("cpu")), warmup_iters=CHECKED_STEPS,
                               timing_steps=0)
    assert "memory_growth" not in [f.kind for f in report.findings], report.table()
    assert gc.get_freeze_count() == 0  # thawed

    kept = _Holder()
    gc.freeze()  # the process's own: the doctor leaves them frozen
    try:
        frozen = gc.get_freeze_count()
        case, report = diagnose_case("memory_growth")
        assert "memory_growth" in [f.kind for f in report.findings], report.table()
        assert frozen / 2 < gc.get_freeze_count() <= frozen  # not thawed (0); a few freed since by their refcount
    finally:
        gc.unfreeze()
    assert kept.me is kept
