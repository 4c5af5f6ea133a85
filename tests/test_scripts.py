"""A user runs the scripts: each reads train.py's config as train.py does; compare and sweep.

Every script that takes train.py's overrides reads them the same way (trainer/run/cli.py):
``--help`` says how, ``--config-dir`` brings the user's own configs, a config that does not
compose is one line with train.py's exit code. A user compares graph modes
(scripts/compare.py) and sweeps batch sizes (scripts/sweep.py): on CPU only eager runs; the
graph modes show up as not available. The scripts run as real subprocesses, and so do the
train.py runs they launch; W&B is offline and read back from disk.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers.availability import cuda_count
from helpers.launches import Finished, launch, launch_together
from helpers.paths import ROOT
from helpers.wandb_offline import find_runs, read_run
from scripts.lib.comparison import comparison_rows, markdown_table, plot_comparison
from scripts.lib.launch import NOT_AVAILABLE
from scripts.sweep import plot_sweep, sweep_table
from test_external_recipe import RECIPE

GRAPH_MODES = ["full", "partial", "compile", "full_compiled"]

cpu_only = pytest.mark.skipif(cuda_count() > 0, reason="checks the CPU behaviour (graph modes unavailable)")


def script(name: str, *args: str, timeout: float = 120, cwd: Path = ROOT, env: dict = None) -> Finished:
    """Runs scripts/<name> (or train.py) from ``cwd``, the way a user does (tests/helpers/launches.py: past
    ``timeout`` the test fails and everything the script started is stopped)."""
    path = ROOT / name if name == "train.py" else ROOT / "scripts" / name
    return launch(list(args), script=str(path), cwd=cwd, env=env, timeout=timeout)


def table_rows(markdown: str) -> dict:
    """{mode: [cells]} from the comparison table in compare.md."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}


@pytest.fixture(scope="module")
def compare_and_sweep(tmp_path_factory):
    """Launched together: one comparison of every mode, two processes each, W&B offline ("compare"), and a
    sweep of mnist over two batch sizes, one process each ("sweep", the one-process path of compare):
    {name: (its output folder, the launch)}."""
    folder = tmp_path_factory.mktemp("compare_and_sweep")
    outputs = {"compare": folder / "cmp-test", "sweep": folder / "sw"}
    args = {"compare": ["--nproc", "2", "--timeout", "90", "--output", str(outputs["compare"]), "--",
                        "experiment=debug"],
            "sweep": ["--recipes", "mnist", "--batch-sizes", "16,32", "--nprocs", "1", "--timeout", "90",
                      "--output", str(outputs["sweep"]), "--", "experiment=debug", "logger=none"]}
    done = launch_together(args, timeout=240, each={name: {"script": str(ROOT / "scripts" / f"{name}.py")}
                                                    for name in args})
    return {name: (outputs[name], proc) for name, proc in done.items()}


@pytest.fixture(scope="module")
def comparison(compare_and_sweep):
    """The comparison of every mode: what the tests below read."""
    output, proc = compare_and_sweep["compare"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return output, proc


@cpu_only
def test_compare_prints_and_saves_the_table_json_and_chart(comparison):
    output, proc = comparison
    for name in ("compare.md", "compare.json", "compare.png"):
        assert (output / name).stat().st_size > 0, name
    rows = table_rows((output / "compare.md").read_text())
    assert list(rows) == ["eager", *GRAPH_MODES]
    eager = rows["eager"]
    assert float(eager[1].replace(",", "")) > 0  # samples/s
    assert eager[4] == "1.00x" and eager[-1] == "ok"
    for mode in GRAPH_MODES:
        assert rows[mode][-1] == NOT_AVAILABLE
    assert "| eager |" in proc.stdout and NOT_AVAILABLE in proc.stdout

    saved = json.loads((output / "compare.json").read_text())
    by_mode = {row["mode"]: row for row in saved["rows"]}
    assert by_mode["eager"]["throughput"] > 0 and by_mode["eager"]["speedup"] == 1.0
    assert by_mode["eager"]["unit"] == "samples/s" and 0 <= by_mode["eager"]["eval_accuracy"] <= 1
    assert by_mode["full"]["throughput"] is None and by_mode["full"]["status"] == NOT_AVAILABLE
    eager_run = Path(by_mode["eager"]["run_dir"])
    assert eager_run.parent.parent == output / "runs" / "eager"  # output_root=<output>/runs/<mode>
    assert json.loads((eager_run / "results.json").read_text())["mode"] == "eager"


@cpu_only
def test_compare_groups_its_runs_in_wandb(comparison):
    output, _ = comparison
    eager_run = Path(json.loads((output / "compare.json").read_text())["rows"][0]["run_dir"])
    [train_file] = find_runs(eager_run)
    train = read_run(train_file)
    assert (train.group, train.job_type) == ("cmp-test", "eager")
    assert "perf/samples_per_s" in train.keys()

    [compare_file] = find_runs(output)
    summary_run = read_run(compare_file)
    assert (summary_run.group, summary_run.job_type) == ("cmp-test", "compare")
    assert {"comparison/_type", "comparison_chart/_type"} <= summary_run.keys()
    assert summary_run.summary["speedup/eager"] == 1.0 and summary_run.exit_code == 0


def test_a_scripts_wandb_run_honours_an_explicit_logger_wandb_mode(tmp_path, capsys):
    # The mode comes from the config as an Enum; W&B must get its value, not the Enum.
    from conf.schema import compose
    from scripts.lib.comparison import log_to_wandb

    cfg = compose(["logger.wandb.mode=offline"])
    run_dir = log_to_wandb(cfg.logger, tmp_path, group="g", job_type="compare", name="n", config={},
                           table_key="rows", rows=[{"mode": "eager", "speedup": 1.0}], images={}, summary={"x": 1})
    assert run_dir is not None, capsys.readouterr().err
    [run_file] = find_runs(tmp_path)
    run = read_run(run_file)
    assert run.job_type == "compare" and run.summary["x"] == 1 and "rows/_type" in run.keys()


@cpu_only
def test_compare_with_two_processes_launches_torchrun(comparison):
    output, _ = comparison
    [row] = [r for r in json.loads((output / "compare.json").read_text())["rows"] if r["mode"] == "eager"]
    assert row["status"] == "ok" and row["world_size"] == 2 and row["throughput"] > 0
    assert "torch.distributed.run --standalone --nproc_per_node=2" in (output / "runs/eager/command.txt").read_text()


@cpu_only
def test_overrides_the_script_sets_itself_are_refused(tmp_path):
    proc = script("compare.py", "--output", str(tmp_path), "--", "graph=full")
    assert proc.returncode == 2, proc.stderr[-3000:]  # a refusal (scripts/lib/refuse.py), not a crash (1)
    assert proc.stderr.count("'graph=full' is set by this script") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@cpu_only
@pytest.mark.fast
def test_a_value_a_script_writes_into_an_override_reads_back_as_itself_in_hydra():
    """scripts/lib/launch.py ``hydra_value``, the one way the scripts write a value into a train.py override: Hydra's
    own parser reads back the same value, of the same type (a path with spaces, quotes or backslashes, a word Hydra
    would read as a bool, null or a number, a list, a whole nested model config)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from scripts.lib.launch import hydra_value
    from scripts.lib.llama3 import SHAPES, hf_config

    parser = OverridesParser.create()
    values = ["/tmp/runs/a b", "it's", "/x/run-1.2", "true", "null", "123", "1e-5", "nan", "", "a,b=c:d", "C:\\dir\\",
              "x\\'y", "${x}", 0.95, 3e-4, 7, True, None, [0.9, 0.95], hf_config(SHAPES["1b"])]
    for value in values:
        text = hydra_value(value)
        read = parser.parse_override(f"key={text}").value()
        assert read == value and type(read) is type(value), (value, text, read)
    assert hydra_value("/tmp/plain/path") == "/tmp/plain/path" and hydra_value([0.9, 0.95]) == "[0.9,0.95]"


def test_check_fsdp2_puts_sharded_training_next_to_ddp_in_one_table(tmp_path):
    tiny = ["recipe=gpt_tiny", "recipe.model.n_layer=1", "recipe.model.d_model=32", "recipe.model.n_head=2",
            "recipe.model.context=16"]
    proc = script("check_fsdp2.py", "--nproc", "2", "--steps", "14", "--output", str(tmp_path), "--", *tiny,
                  timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "check_fsdp2.json").read_text())["rows"]
    assert [(r["parallel"], r["mode"]) for r in rows] == [("ddp", "eager"), ("ddp", "full"), ("fsdp2", "eager"),
                                                         ("fsdp2", "full")]
    ddp, fsdp2 = (next(r for r in rows if (r["parallel"], r["mode"]) == (p, "eager")) for p in ("ddp", "fsdp2"))
    for row in (ddp, fsdp2):  # on CPU the eager pair runs over gloo; graph=full is not available
        assert row["status"] == "ok" and row["world_size"] == 2 and row["throughput"] > 0, row
    assert fsdp2["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-3)  # sharded, it trains as DDP does
    assert all(r["status"] == NOT_AVAILABLE for r in rows if r["mode"] == "full")
    assert "| fsdp2 | eager |" in proc.stdout and (tmp_path / "check_fsdp2.md").read_text() in proc.stdout


def outcome(mode, samples_per_s=None, **results):
    if samples_per_s is None:
        return {"mode": mode, "status": NOT_AVAILABLE, "results": {}}
    return {"mode": mode, "status": "ok",
            "results": {"perf/samples_per_s": samples_per_s, "perf/step_ms_median": 2.0, "perf/step_ms_p90": 2.5,
                        "final/loss": 0.12345, "final/eval_accuracy": 0.9876, **results}}


def test_speedup_is_each_modes_throughput_over_eagers():
    full = outcome("full", 2500.0, **{"graph/train_capture_s": 0.5, "graph/graph_pool_mib": 12.34})
    rows = comparison_rows([outcome("eager", 1000.0), full, outcome("partial")])
    assert [row["speedup"] for row in rows] == [1.0, 2.5, None]
    table = table_rows(markdown_table(rows))
    assert table["eager"][:5] == ["eager", "1,000", "2.00", "2.50", "1.00x"]
    assert table["full"][1:6] == ["2,500", "2.00", "2.50", "2.50x", "0.50"]
    assert table["full"][6] == "12.3" and table["full"][8:] == ["0.1235", "98.76%", "ok"]
    assert table["partial"][1:-1] == ["—"] * 9 and table["partial"][-1] == NOT_AVAILABLE
    assert markdown_table(rows).splitlines()[0].startswith("| mode | samples/s | step ms median |")


def test_without_an_eager_run_there_is_no_speedup():
    rows = comparison_rows([{"mode": "eager", "status": "failed (exit 1): boom | bang", "results": {}},
                            outcome("full", 2500.0)])
    assert [row["speedup"] for row in rows] == [None, None]
    table = markdown_table(rows)
    assert "boom \\| bang" in table  # a '|' in a message does not split the cell
    assert table_rows(table)["full"][4] == "—"
    assert comparison_rows([outcome("full", 2500.0)])[0]["speedup"] is None


def test_language_model_results_are_reported_in_tokens(tmp_path):
    rows = comparison_rows([{"mode": "eager", "status": "ok", "results": {"perf/tokens_per_s": 4e5}}])
    assert rows[0]["unit"] == "tokens/s" and rows[0]["throughput"] == 4e5
    assert "| mode | tokens/s |" in markdown_table(rows)
    assert plot_comparison(rows, tmp_path / "chart.png").stat().st_size > 0


@cpu_only
def test_sweep_on_cpu_writes_json_and_plot_with_graph_points_unavailable(compare_and_sweep):
    output, proc = compare_and_sweep["sweep"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep = json.loads((output / "sweep.json").read_text())
    points = {(p["batch_size"], p["mode"]): p for p in sweep["points"]}
    assert set(points) == {(16, "eager"), (32, "eager"), (16, "full"), (32, "full")}
    for batch_size in (16, 32):
        eager, full = points[batch_size, "eager"], points[batch_size, "full"]
        assert eager["status"] == "ok" and eager["throughput"] > 0 and eager["nproc"] == 1
        assert full["status"] == NOT_AVAILABLE and full["speedup"] is None
        results = json.loads((Path(eager["run_dir"]) / "results.json").read_text())
        assert results["global_batch"] == batch_size
    assert (output / "sweep_mnist.png").stat().st_size > 0
    assert (output / "mnist_n1_bs16" / "compare.md").exists()


def test_sweep_table_and_plot_from_gpu_like_points(tmp_path):
    points = []
    for nproc in (1, 2):
        for batch_size in (16, 64):
            rows = comparison_rows([outcome("eager", 1000.0 * nproc), outcome("full", 2500.0 * nproc)])
            points += [{"recipe": "mnist", "nproc": nproc, "batch_size": batch_size, **row} for row in rows]
    table = sweep_table(points, ["eager", "full"])
    header = "| recipe | nproc | batch size/rank | eager samples/s | full samples/s | speedup full |"
    assert table.splitlines()[0] == header
    assert "| mnist | 2 | 64 | 2,000 | 5,000 | 2.50x |" in table
    assert plot_sweep(points, tmp_path / "sweep.png", title="mnist").stat().st_size > 0


def test_scaling_rows_give_speedup_over_eager_and_efficiency_per_gpu_count():
    from scripts.plot_scaling import scaling_rows

    rows = scaling_rows({"eager": {1: 100.0, 2: 150.0}, "full": {1: 1000.0, 2: 1800.0}})
    full2 = next(r for r in rows if r["mode"] == "full" and r["gpus"] == 2)
    assert full2["speedup_vs_eager"] == pytest.approx(12.0)
    assert full2["efficiency"] == pytest.approx(0.9)
    eager2 = next(r for r in rows if r["mode"] == "eager" and r["gpus"] == 2)
    assert eager2["efficiency"] == pytest.approx(0.75)


def _point(nproc, batch, mode, ms):
    return {"recipe": "mnist", "nproc": nproc, "batch_size": batch, "mode": mode, "step_ms_median": ms, "status": "ok"}


@pytest.mark.fast
def test_the_scaling_projection_follows_its_stated_model(tmp_path):
    from scripts.project_scaling import main

    points = [_point(1, b, "eager", ms) for b, ms in ((16, 2.0), (64, 2.4), (256, 3.0))]
    points += [_point(1, b, "full", ms) for b, ms in ((16, 0.15), (64, 0.25), (256, 0.6))]
    points += [_point(2, 64, "eager", 2.6)]
    (tmp_path / "sweep.json").write_text(json.dumps({"points": points}))
    assert main(["--sweep", str(tmp_path / "sweep.json"), "--recipe", "mnist", "--global-batch", "256",
                 "--gpus", "1,2,512", "--params", "1000000", "--allreduce-scale", "1", "--output", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "projection.json").read_text())
    one, two, many = out["rows"]
    assert (one["eager_step_ms"], one["full_step_ms"], one["allreduce_ms"]) == (3.0, 0.6, 0.0)  # measured, no comm
    # 2 GPUs: batch 128, log-log between 64 and 256; a ring of 2 over NVLink for 4 MB: 2*(1/2)*4e6/360e9 + 2*5e-6 s
    assert two["eager_step_ms"] == pytest.approx((2.4 * 3.0) ** 0.5 + 0.021111, rel=1e-4)
    # 512 GPUs: batch 0.5 stays at the smallest measured (16); 8 GPUs a node, then 64 nodes over InfiniBand,
    # where a tree (6 levels) beats a ring (63 steps) for 0.5 MB shards
    comm = 1e3 * (2 * 7 / 8 * 4e6 / 360e9 + 2 * 7 * 5e-6 + 2 * 4e6 / 8 / 45e9 + 2 * 6 * 10e-6)
    assert many["allreduce_ms"] == pytest.approx(comm, rel=1e-6)
    assert many["graph_speedup"] == pytest.approx((2.0 + comm) / (0.15 + comm), rel=1e-6)
    [check] = out["two_gpu_check"]
    assert check["predicted_ms"] == pytest.approx(2.4 + 0.021111, rel=1e-4) and check["error"] < 0
    assert "| 512 | 0.5 |" in (tmp_path / "projection.md").read_text()


@pytest.mark.fast
def test_the_projection_takes_the_measured_allreduce_scale_and_bf16_gradients(tmp_path):
    from scripts.project_scaling import main

    points = [_point(1, b, mode, ms) for b in (16, 64) for mode, ms in (("eager", 2.0), ("full", b / 100))]
    (tmp_path / "sweep.json").write_text(json.dumps({"points": points}))
    base = ["--sweep", str(tmp_path / "sweep.json"), "--recipe", "mnist", "--global-batch", "64", "--gpus", "2",
            "--params", "1000000"]
    assert main([*base, "--allreduce-scale", "1", "--output", str(tmp_path / "model")]) == 0
    assert main([*base, "--output", str(tmp_path / "measured")]) == 0  # by default, the scale measured on 2 H200s
    measured = json.loads((tmp_path / "measured" / "projection.json").read_text())
    assert measured["allreduce_scale"] == 1.73
    assert main([*base, "--allreduce-scale", "3", "--grad-bytes-per-param", "2", "--output", str(tmp_path / "fit")]) == 0
    [model] = json.loads((tmp_path / "model" / "projection.json").read_text())["rows"]
    fit = json.loads((tmp_path / "fit" / "projection.json").read_text())
    # a ring of 2 over NVLink: bandwidth term halves with bf16 gradients, the latency term stays; then x3
    assert model["allreduce_ms"] == pytest.approx(1e3 * (4e6 / 360e9 + 2 * 5e-6), rel=1e-9)
    assert measured["rows"][0]["allreduce_ms"] == pytest.approx(1.73 * model["allreduce_ms"], rel=1e-9)
    assert fit["rows"][0]["allreduce_ms"] == pytest.approx(3e3 * (2e6 / 360e9 + 2 * 5e-6), rel=1e-9)
    assert fit["rows"][0]["full_step_ms"] == pytest.approx(0.32 + fit["rows"][0]["allreduce_ms"])
    assert (fit["allreduce_scale"], fit["grad_bytes"]) == (3.0, 2e6)
    assert "all-reduce x3" in (tmp_path / "fit" / "projection.md").read_text()


@pytest.mark.fast
def test_the_projection_does_not_extrapolate_beyond_the_sweep(tmp_path):
    from scripts.project_scaling import main

    points = [_point(1, b, mode, ms) for b in (16, 64) for mode, ms in (("eager", 2.0), ("full", b / 100))]
    (tmp_path / "sweep.json").write_text(json.dumps({"points": points}))
    assert main(["--sweep", str(tmp_path / "sweep.json"), "--recipe", "mnist", "--global-batch", "128",
                 "--gpus", "1,2", "--params", "1000", "--output", str(tmp_path)]) == 0
    one, two = json.loads((tmp_path / "projection.json").read_text())["rows"]
    assert one["eager_step_ms"] is None and one["full_step_ms"] is None and "graph_speedup" not in one
    assert two["full_step_ms"] == pytest.approx(0.64 + two["allreduce_ms"])
    assert "| 1 | 128 | 0.000 | beyond the sweep | beyond the sweep | — |" in (tmp_path / "projection.md").read_text()


# ---- every script reads train.py's config as train.py does ------------------------------

OVERRIDE_SCRIPTS = ["doctor.py", "profile_step.py", "bench_input.py", "bench_checkpointing.py", "bench_shapes.py",
                    "bench_gpt2.py", "export_images.py", "project_scaling.py", "compare.py", "sweep.py",
                    "check_fsdp2.py", "bench_torchtitan.py", "bench_trl.py", "bench_watchdog.py",
                    "bench_images.py"]
# It imports torch at module level (an example to read top to bottom): its --help takes torch's import time too.
TORCH_AT_IMPORT = {"own_loop.py"}
ALL_SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py") if p.name != "__init__.py")


@pytest.fixture(scope="module")
def help_of():
    """``python scripts/<name> --help``, once per script, with Python's import log on stderr (PYTHONPROFILEIMPORTTIME):
    read by the test of what --help says and by the test of what it imports."""
    runs = {}

    def run(name: str) -> Finished:
        if name not in runs:
            runs[name] = script(name, "--help", timeout=60, env={"PYTHONPROFILEIMPORTTIME": "1"})
        return runs[name]

    return run


def own_stderr(proc: Finished) -> str:
    """stderr without Python's import log."""
    return "".join(line for line in proc.stderr.splitlines(keepends=True) if not line.startswith("import time:"))


def imported(proc: Finished) -> set:
    """The modules the run imported, from Python's import log."""
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("name", ALL_SCRIPTS)
def test_every_script_answers_help(name, help_of):
    proc = help_of(name)
    assert proc.returncode == 0, own_stderr(proc)[-3000:]
    assert proc.stdout.startswith("usage: ") and not own_stderr(proc)
    if name in OVERRIDE_SCRIPTS:  # the script's options, then how train.py's part is passed
        assert "train.py's config" in proc.stdout
        for words in ("key=value", "+key=value", "~key", "--config-dir DIR, -cd DIR", "--config-name NAME, -cn NAME",
                      "python train.py --help"):
            assert words in proc.stdout, words


@pytest.mark.parametrize("name", sorted(set(ALL_SCRIPTS) - TORCH_AT_IMPORT))
def test_a_scripts_help_does_not_import_torch(name, help_of):
    proc = help_of(name)
    assert "usage: " in proc.stdout and "argparse" in imported(proc), own_stderr(proc)[-3000:]  # the log is there
    assert "torch" not in imported(proc), sorted(m for m in imported(proc) if m.startswith("torch"))[:5]


@pytest.fixture
def user_configs(tmp_path):
    """A user's package on PYTHONPATH and their own config tree: my_conf/recipe/mine.yaml."""
    package = tmp_path / "site" / "user_recipes"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rings.py").write_text(textwrap.dedent(RECIPE))
    (tmp_path / "my_conf" / "recipe").mkdir(parents=True)
    (tmp_path / "my_conf" / "recipe" / "mine.yaml").write_text(textwrap.dedent("""\
        # @package _global_
        recipe:
          _target_: user_recipes.rings.build
          name: rings
          model: {width: 16}
          data: {batch_size: 64, eval_batch_size: 128}
          optim: {_target_: torch.optim.AdamW, lr: 0.01}
          schedule: {_target_: trainer.step.schedules.Constant, warmup_steps: 0}
        train: {epochs: 1, log_every: 16}
        """))
    pythonpath = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)
    return tmp_path, {"PYTHONPATH": pythonpath}


def test_the_doctor_diagnoses_a_recipe_from_the_users_own_config_dir(user_configs):
    home, env = user_configs  # run from the user's directory, --config-dir relative to it, as with train.py
    proc = script("doctor.py", "--config-dir", "my_conf", "recipe=mine", "logger=none", "output_root=out",
                  cwd=home, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "verdict: ready (exit 0)" in proc.stdout
    [report] = (home / "out").rglob("doctor.json")
    saved = json.loads(report.read_text())
    assert saved["recipe"] == "rings" and saved["verdict"] == "ready"
    assert "rings" in report.parent.name  # the doctor's own run directory


@cpu_only
def test_compare_passes_the_config_dir_to_its_runs_and_records_a_failed_runs_exit_code_and_message(user_configs):
    home, env = user_configs  # train.epochs=0 stops each run at its config check: quick, and only
    # a train.py that found recipe/mine.yaml gets that far (without it: "Could not find 'recipe/mine'")
    proc = script("compare.py", "--modes", "eager", "--nproc", "1", "--output", "cmp", "--",
                  "-cd", "my_conf", "recipe=mine", "logger=none", "train.epochs=0", cwd=home, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [row] = json.loads((home / "cmp" / "compare.json").read_text())["rows"]
    assert row["status"].startswith("failed (exit 2): Error: train.epochs=0 must be at least 1"), row["status"]
    assert "failed (exit 2)" in (home / "cmp" / "compare.md").read_text()
    assert f"train.py --config-dir {home / 'my_conf'} recipe=mine" in (home / "cmp/runs/eager/command.txt").read_text()


BAD_CONFIGS = [  # (script arguments, train.py's words for it)
    (["recipe=nope"], "In 'train': Could not find 'recipe/nope'"),
    (["train.epochs=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
    (["train.epochz=3"], "Key 'epochz' not in 'TrainLoopConfig'"),
    (["--config-dir", "/no/such/dir"], "Additional config directory '/no/such/dir' not found"),
]


@pytest.mark.parametrize("args,words", BAD_CONFIGS, ids=["unknown-recipe", "bad-value", "unknown-key", "no-config-dir"])
def test_a_config_that_does_not_compose_is_one_line_with_train_pys_exit_code(tmp_path, args, words):
    train = script("train.py", *args, f"output_root={tmp_path}", timeout=60)
    assert words in train.stderr and train.returncode != 0  # train.py's own words and code: the oracle
    for name, own in (("doctor.py", []), ("export_images.py", ["--output", str(tmp_path / "png")]),
                      ("compare.py", ["--output", str(tmp_path / "cmp"), "--"])):
        proc = script(name, *own, *args, timeout=60)
        assert proc.returncode == train.returncode, proc.stderr[-3000:]
        assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(f"{name}: ")
        assert words in proc.stderr and "Traceback" not in proc.stderr and not proc.stdout
    assert not any(tmp_path.iterdir()), "nothing written"


@pytest.mark.parametrize("name", sorted(set(OVERRIDE_SCRIPTS) - {"doctor.py", "export_images.py", "compare.py"}))
def test_every_script_reports_a_bad_choice_as_train_py_does(tmp_path, name):
    own = {"bench_input.py": ["--folder", str(tmp_path / "png")],
           "project_scaling.py": ["--sweep", str(tmp_path / "none.json"), "--recipe", "mnist", "--global-batch", "64"],
           "sweep.py": ["--output", str(tmp_path / "sw"), "--"],
           "bench_images.py": ["--root", str(tmp_path / "photos")]}.get(name, [])
    proc = script(name, *own, "graph.capture_error_mode=sometimes", timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]  # train.py's code for it (trainer/run/errors.py EXIT_CONFIG)
    assert proc.stderr == (f"{name}: Error merging override graph.capture_error_mode=sometimes; "
                           "Invalid value 'sometimes', expected one of [global, thread_local, relaxed]\n")
    assert not any(tmp_path.iterdir())


def test_an_option_the_script_does_not_have_is_argparses_error():
    proc = script("doctor.py", "--steps", "3", "recipe=mnist", timeout=60)
    assert proc.returncode == 2 and "doctor.py: error: unrecognized arguments: --steps" in proc.stderr


# ---- issue 24's levers -----------------------------------------------------------------

@pytest.mark.fast
@pytest.mark.parametrize("rows", [4, 10, 64])  # uneven chunks, one chunk, a chunk larger than the tokens
def test_the_chunked_linear_cross_entropy_lever_equals_cross_entropy_in_value_and_gradients(rows):
    import torch
    import torch.nn.functional as F

    from scripts.reference_gpt2 import chunked_linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (10,))
    chunked = chunked_linear_cross_entropy(hidden, weight, targets, rows) * 3  # backward gets a gradient of 3
    plain = F.cross_entropy(hidden @ weight.t(), targets) * 3
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)  # losses summed in fp32
    for mine, theirs in zip(torch.autograd.grad(chunked, (hidden, weight)), torch.autograd.grad(plain, (hidden, weight))):
        assert mine.dtype == theirs.dtype and torch.allclose(mine, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.fast
def test_profile_steps_idle_gaps_are_the_time_no_stream_runs_an_op():
    from types import SimpleNamespace

    from scripts.lib.kernel_profile import idle_gaps

    def op(start, end, name):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    # b overlaps c on another stream (no gap between them); idle: a→b 2 us, c→d 10 us, d→b 2 us, over 2 steps
    ops = [op(0, 10, "a"), op(12, 20, "b"), op(15, 30, "c"), op(40, 50, "d"), op(52, 60, "b")]
    idle_ms, rows = idle_gaps(ops, steps=2, n=2)
    assert idle_ms == pytest.approx(0.007)
    assert [(r["after"], r["before"]) for r in rows] == [("c", "d"), ("a", "b")]
    assert rows[0]["ms_per_step"] == pytest.approx(0.005) and rows[0]["per_step"] == 0.5


@pytest.mark.fast
def test_the_projection_reads_the_committed_sweeps_file_layout(tmp_path, capsys):
    """scripts/results/sweeps_h200.json keeps one-GPU sweeps by recipe, its points without recipe or nproc."""
    from scripts.project_scaling import main

    points = [_point(1, b, mode, ms) for b in (16, 64) for mode, ms in (("eager", 2.0), ("full", b / 100))]
    bare = [{k: v for k, v in p.items() if k not in ("recipe", "nproc")} for p in points]
    (tmp_path / "flat.json").write_text(json.dumps({"points": points}))
    (tmp_path / "by_recipe.json").write_text(json.dumps({"sweeps": {"mnist": {"points": bare}, "gpt_tiny": {"points": []}}}))
    rows = {}
    for name in ("flat", "by_recipe"):
        assert main(["--sweep", str(tmp_path / f"{name}.json"), "--recipe", "mnist", "--global-batch", "64",
                     "--gpus", "1,2", "--params", "1000000", "--output", str(tmp_path / name)]) == 0
        rows[name] = json.loads((tmp_path / name / "projection.json").read_text())["rows"]
    assert rows["by_recipe"] == rows["flat"] and len(rows["flat"]) == 2
    capsys.readouterr()
    for sweep, words in (("by_recipe.json", "no 1-GPU eager"), ("none.json", "no such file")):
        with pytest.raises(SystemExit) as refused:
            main(["--sweep", str(tmp_path / sweep), "--recipe", "gpt_tiny", "--global-batch", "64",
                  "--params", "1000000"])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and err.count(words) == 1 and len(err.splitlines()) == 1, err


@pytest.mark.fast
def test_profile_step_tells_streams_apart_and_measures_collectives_beside_compute():
    from scripts.lib.kernel_profile import collective_overlap, stream_table

    # (start us, end us, kernel, stream) of two steps: compute on stream 7, FSDP2's collectives on stream 13.
    spans = [(0, 10, "sm90_gemm", 7), (12, 20, "sm90_gemm", 7), (5, 15, "ncclDevKernel_AllGather", 13),
             (30, 40, "ncclDevKernel_ReduceScatter", 13)]
    table = stream_table(spans, steps=2)
    assert [(row["stream"], row["collectives"]) for row in table] == [(13, True), (7, False)]
    assert table[0]["ms_per_step"] == pytest.approx(0.010) and table[1]["ops_per_step"] == 1.0
    total, beside = collective_overlap(spans, steps=2)
    assert total == pytest.approx(0.010) and beside == pytest.approx(0.004)  # 8 of the 20 us beside a gemm


@pytest.mark.fast
def test_kernels_are_sorted_into_kinds_by_their_names_as_profiles_show_them():
    from types import SimpleNamespace

    from scripts.lib.kernel_profile import OTHER, kernel_kind, kinds_table

    names = {  # names as torch.profiler gave them on H200s (shortened where long), and their kinds
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmuls",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmuls",
        "triton_tem_fused_mm_0": "matmuls",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, "
        "FusedAdamMathFunctor<float, 4, (ADAM_MODE)1, false>>": "optimizer (fused Adam)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<1>, "
        "LpNormFunctor<float, (NormType)1>>": "foreach (clipping, FSDP2 copy-in)",
        "void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float, float>": "FSDP2 copies (chunk_cat, split)",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "collectives (NCCL)",
        "Memcpy DtoD (Device -> Device)": "memory copies and sets",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "fused kernels (Triton)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other elementwise and "
                                                                                               "reductions",
        "void cub::DeviceRadixSortOnesweepKernel": OTHER,
    }
    assert {name: kernel_kind(name) for name in names} == names
    events = [SimpleNamespace(name=name, device_time=t) for name, t in
              (("nvjet_a", 300.0), ("ncclDevKernel_AllGather", 100.0), ("nvjet_b", 100.0), ("cub::x", 40.0))]
    assert kinds_table(events, steps=2) == [  # KINDS' order, per step, the empty kinds left out
        {"kind": "collectives (NCCL)", "ms_per_step": pytest.approx(0.05), "per_step": 0.5},
        {"kind": "matmuls", "ms_per_step": pytest.approx(0.2), "per_step": 1.0},
        {"kind": OTHER, "ms_per_step": pytest.approx(0.02), "per_step": 0.5}]


@pytest.mark.fast
def test_a_profiles_gpu_events_are_its_kernels_not_the_annotations_spanning_them():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from scripts.lib.kernel_profile import device_events

    def event(name, device_type=DeviceType.CUDA, index=0, annotation=False):
        return SimpleNamespace(name=name, device_type=device_type, device_index=index, is_user_annotation=annotation)

    # What an eager FSDP2 step's trace holds: a kernel, the GPU span of the record_function range around it, the
    # CPU op, and a peer's kernel on GPU 1.
    trace = [event("ncclDevKernel_AllGather_RING_LL"), event("nccl:_all_gather_base", annotation=True),
             event("Optimizer.step#AdamW.step", annotation=True), event("aten::mm", device_type=DeviceType.CPU),
             event("nvjet_tst", index=1), event("Memcpy HtoD (Pinned -> Device)", index=-1)]
    kept = device_events(SimpleNamespace(events=lambda: trace), device=0)
    assert [e.name for e in kept] == ["ncclDevKernel_AllGather_RING_LL", "Memcpy HtoD (Pinned -> Device)"]


@pytest.mark.fast
@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_profiling_a_scripts_own_steps_runs_each_once_and_reads_them_per_step():
    """kernel_profile.profile_steps, what the torchtitan worker and reference_gpt2.py profile their own loops with:
    each step runs once under the profiler, and the summary is per step; on the CPU there is no GPU work to read."""
    import torch

    from scripts.lib.kernel_profile import profile_steps

    calls = []
    x = torch.randn(64, 64)
    result = profile_steps(lambda: calls.append(float((x @ x).sum())), 3, device=0)
    assert len(calls) == 3 and result["steps"] == 3
    assert result["gpu_ops_per_step"] == 0 and result["kinds"] == [] and result["gpu_busy_ms"] == 0


@pytest.mark.fast
def test_the_pool_report_tells_a_graphs_reserved_memory_from_what_it_ever_held_at_once():
    from scripts.lib.memory_pools import describe, pool_report

    MiB = 2 ** 20
    # The allocator's snapshot in its documented form: the default pool's segment (weights), and a graph's pool
    # of two segments: the compute stream (7) reuses 4 MiB once; a collective's stream (13) frees 6 MiB that waits
    # (a block another stream used) until after the capture, so the 8 MiB allocated after it takes a new segment.
    segments = [{"address": 0, "total_size": 10 * MiB, "allocated_size": 10 * MiB, "segment_pool_id": (0, 0)},
                {"address": 100 * MiB, "total_size": 8 * MiB, "allocated_size": 0, "segment_pool_id": (1, 2)},
                {"address": 200 * MiB, "total_size": 14 * MiB, "allocated_size": 0, "segment_pool_id": (1, 2)}]
    trace = [{"action": "segment_alloc", "addr": 0, "size": 10 * MiB, "stream": 0},  # old torch: no pool_id
             {"action": "alloc", "addr": 0, "size": 10 * MiB, "stream": 0},
             {"action": "segment_alloc", "addr": 100 * MiB, "size": 8 * MiB, "stream": 7, "pool_id": (1, 2)},
             {"action": "alloc", "addr": 100 * MiB, "size": 4 * MiB, "stream": 7, "pool_id": (1, 2)},
             {"action": "free_requested", "addr": 100 * MiB, "size": 4 * MiB, "stream": 7, "pool_id": (1, 2)},
             {"action": "free_completed", "addr": 100 * MiB, "size": 4 * MiB, "stream": 7, "pool_id": (1, 2)},
             {"action": "alloc", "addr": 100 * MiB, "size": 4 * MiB, "stream": 7, "pool_id": (1, 2)},
             {"action": "segment_alloc", "addr": 200 * MiB, "size": 14 * MiB, "stream": 13, "pool_id": (1, 2)},
             {"action": "alloc", "addr": 200 * MiB, "size": 6 * MiB, "stream": 13, "pool_id": (1, 2)},
             {"action": "free_requested", "addr": 200 * MiB, "size": 6 * MiB, "stream": 13, "pool_id": (1, 2)},
             {"action": "alloc", "addr": 206 * MiB, "size": 8 * MiB, "stream": 13, "pool_id": (1, 2)},
             {"action": "free_requested", "addr": 100 * MiB, "size": 4 * MiB, "stream": 7, "pool_id": (1, 2)},
             {"action": "free_completed", "addr": 100 * MiB, "size": 4 * MiB, "stream": 7, "pool_id": (1, 2)},
             {"action": "free_requested", "addr": 206 * MiB, "size": 8 * MiB, "stream": 13, "pool_id": (1, 2)},
             {"action": "free_completed", "addr": 206 * MiB, "size": 8 * MiB, "stream": 13, "pool_id": (1, 2)},
             {"action": "free_completed", "addr": 200 * MiB, "size": 6 * MiB, "stream": 13, "pool_id": (1, 2)}]
    default, graph = pool_report({"segments": segments, "device_traces": [trace]})
    assert (default["graph"], default["reserved_mib"], default["allocated_mib"], default["peak_live_mib"]) == \
        (False, 10.0, 10.0, 10.0)  # its entries named no pool: found by address
    assert (graph["graph"], graph["pool"], graph["segments"], graph["reserved_mib"]) == (True, [1, 2], 2, 22.0)
    assert graph["peak_live_mib"] == 12.0  # 4 + 8 (the 6 had been freed): 10 of the 22 reserved were never live
    assert graph["peak_waiting_mib"] == 6.0 and graph["segments_mib"] == 22.0
    assert graph["streams"]["13"] == {"peak_live_mib": 8.0, "peak_waiting_mib": 6.0, "segments_mib": 14.0}
    assert graph["streams"]["7"] == {"peak_live_mib": 4.0, "peak_waiting_mib": 0.0, "segments_mib": 8.0}
    lines = describe([default, graph])
    assert lines[0].startswith("  default pool: reserved 10 MiB") and lines[1].startswith("    stream 0: segments 10 MiB")
    assert lines[2].startswith("  graph pool (1, 2): reserved 22 MiB in 2 segments") and "most live at once 12" in lines[2]
    assert lines[3].startswith("    stream 13: segments 14 MiB")  # the stream holding the most first
    named = describe([graph], {"13": "FSDP2 reduce-scatter", "99": "not in this pool"})
    assert named[1].startswith("    stream 13 (FSDP2 reduce-scatter): segments 14 MiB")
    assert named[2].startswith("    stream 7: segments 8 MiB")  # a stream without a name keeps its number
    assert pool_report({"segments": [], "device_traces": []}) == []


@pytest.mark.fast
def test_the_pool_report_counts_the_pages_an_expandable_segment_maps_and_unmaps():
    from scripts.lib.memory_pools import pool_report

    MiB = 2 ** 20
    # expandable_segments:True: one segment per stream that grows by mapping pages and shrinks by unmapping them
    # (torch.cuda.graph's empty_cache before a capture unmaps the free ones); no segment_alloc is ever traced.
    segments = [{"address": 0, "total_size": 6 * MiB, "allocated_size": 0, "segment_pool_id": (1, 0)}]
    trace = [{"action": "segment_map", "addr": 0, "size": 4 * MiB, "stream": 5, "pool_id": (1, 0)},
             {"action": "alloc", "addr": 0, "size": 4 * MiB, "stream": 5, "pool_id": (1, 0)},
             {"action": "segment_map", "addr": 4 * MiB, "size": 6 * MiB, "stream": 5, "pool_id": (1, 0)},
             {"action": "alloc", "addr": 4 * MiB, "size": 6 * MiB, "stream": 5, "pool_id": (1, 0)},
             {"action": "free_requested", "addr": 4 * MiB, "size": 6 * MiB, "stream": 5, "pool_id": (1, 0)},
             {"action": "free_completed", "addr": 4 * MiB, "size": 6 * MiB, "stream": 5, "pool_id": (1, 0)},
             {"action": "segment_unmap", "addr": 6 * MiB, "size": 4 * MiB, "stream": 5, "pool_id": (1, 0)}]
    (graph,) = pool_report({"segments": segments, "device_traces": [trace]})
    assert (graph["reserved_mib"], graph["peak_live_mib"], graph["segments_mib"]) == (6.0, 10.0, 10.0)
    assert graph["streams"]["5"]["segments_mib"] == 10.0  # the most mapped at once, not the 6 left mapped


@pytest.mark.fast
def test_profile_steps_busy_time_counts_overlapping_streams_once():
    from scripts.lib.kernel_profile import union

    # A gemm on one stream and an all-gather beside it: the GPU was busy 0-15 and 30-40 us, not 10 + 10 + 10.
    spans = [(0, 10, "sm90_gemm", 7), (5, 15, "ncclDevKernel_AllGather", 13), (30, 40, "sm90_gemm", 7)]
    assert union(spans) == [[0, 15], [30, 40]]
    assert union([]) == []


@pytest.mark.fast
def test_bench_allreduce_scales_over_every_gpu_count_the_machine_has():
    from scripts.bench_allreduce import gpu_counts, scaling_markdown

    assert gpu_counts(None, 2) == [1, 2] and gpu_counts(None, 4) == [1, 2, 4] and gpu_counts(None, 8) == [1, 2, 4, 8]
    assert gpu_counts("4,2", 4) == [1, 2, 4]  # one GPU is always the baseline
    with pytest.raises(ValueError, match="this machine has 4 GPUs"):
        gpu_counts("1,8", 4)
    with pytest.raises(ValueError, match="a count above 1"):
        gpu_counts("1", 4)
    runs = [{"gpus": n, "throughput": t, "unit": "samples", "speedup": t / 100, "efficiency": t / (100 * n)}
            for n, t in ((1, 100.0), (2, 150.0), (4, 300.0))]
    table = scaling_markdown([{"global_batch": 256, "mode": "full", "runs": runs}])
    assert "| 256 | full | 100 | 150 (1.50x, 0.75) | 300 (3.00x, 0.75) |" in table, table


@pytest.mark.fast
def test_a_refusal_is_one_message_from_rank_0_and_the_config_error_code(capsys, monkeypatch):
    from scripts.lib.refuse import refuse
    from trainer.run.errors import EXIT_CONFIG, EXIT_CRASH

    for rank, said in (("0", "bad input\n"), ("1", "")):  # under torchrun every rank refuses alike: one says it
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as refused:
            refuse("bad input")
        assert refused.value.code == EXIT_CONFIG == 2 != EXIT_CRASH and capsys.readouterr().err == said


NO_CUDA = [  # (script, its arguments, its refusal without a CUDA GPU)
    ("bench_allreduce.py", [], "bench_allreduce.py compares 2 or more GPUs with one: this machine has 0"),
    ("bench_checkpointing.py", [], "bench_checkpointing.py measures GPU memory and step time"),
    ("bench_input.py", ["--folder", "{tmp}/png"], "bench_input.py measures a graphed GPU step"),
    ("profile_step.py", [], "profile_step.py measures GPU kernels"),
    ("reference_gpt2.py", [], "reference_gpt2.py times a GPU"),
]


@cpu_only
@pytest.mark.parametrize("name,args,words", NO_CUDA, ids=[n for n, _, _ in NO_CUDA])
def test_a_benchmark_without_cuda_refuses_with_the_config_error_code(tmp_path, name, args, words):
    proc = script(name, *[a.format(tmp=tmp_path) for a in args], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]  # a refusal (scripts/lib/refuse.py), not a crash (1)
    assert proc.stderr.count(words) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not any(tmp_path.iterdir()), "nothing written"


def test_a_benchmark_run_that_fails_or_hangs_stops_its_script_naming_it(tmp_path, capsys):
    """Every script's child process goes through scripts/lib/launch.py: a run that succeeds is announced, runs
    in the repo with the env given and hands back its wall time; a failed run ends the script with its name and
    stderr (exit 1: a failure, not a refusal); one past its time limit hands back what it printed
    (bench_checkpointing's trials read it)."""
    from scripts.lib.launch import run_captured, run_or_exit

    seen = tmp_path / "seen.json"
    ok = [sys.executable, "-c", "import json, os, sys, time; time.sleep(0.3); "
          "open(sys.argv[1], 'w').write(json.dumps([os.getcwd(), os.environ['BENCH_X']]))", str(seen)]
    began = time.time()
    wall = run_or_exit("bench_x", "ok", ok, timeout=60, env={"BENCH_X": "given"})
    around = time.time() - began
    assert capsys.readouterr().out == f"bench_x: ok: {' '.join(ok[1:])}\n"  # the command, said before it runs
    assert json.loads(seen.read_text()) == [str(ROOT), "given"]  # it ran to its end, in the repo, with the env
    assert 0.3 <= wall <= around  # seconds: the run's own wall time (it sleeps 0.3 s), within the call's
    with pytest.raises(SystemExit, match=r"bench_x: 'broken' failed \(3\):\nboom"):
        run_or_exit("bench_x", "broken", [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"],
                    timeout=60)
    hung = [sys.executable, "-c", "import time; print('report', flush=True); time.sleep(30)"]
    assert run_captured(hung, timeout=1) == ("report\n", "", None)
    with pytest.raises(SystemExit, match="'hung' ran past 1 s"):
        run_or_exit("bench_x", "hung", hung, timeout=1)


def test_the_pretrained_benchmark_refuses_an_override_of_what_it_compares():
    """scripts/bench_pretrained.py sets how the model is loaded and sharded for every run: an override of that is
    one line naming it, exit 2, before anything is written or launched."""
    done = script("bench_pretrained.py", "--size", "tiny", "--", "train.fsdp.init=host", timeout=60)
    assert done.returncode == 2, done.output[-3000:]
    assert "'train.fsdp.init=host' is set by this script for every run: drop it" in done.stderr


def test_bench_gpt2_repeats_give_medians_and_the_range_of_each_pairs_ratio():
    from scripts.bench_gpt2 import combined, markdown

    def run(name, ms, repeat=None):
        return {"name": name, "batch_size": 16, "step_ms": ms, "tokens_per_s": 16 * 1024 * 1e3 / ms, "mfu_pct": 40.0,
                "peak_allocated_mib": 8000.0 + ms, "wall_s": 50.0, "command": name,
                **({} if repeat is None else {"repeat": repeat})}

    ours = "project: full_compiled, recipe defaults"
    # Pair 1 ran with the reference first, pair 2 with ours first: the ratio is taken within each pair
    runs = [run("reference", 33.0, 0), run(ours, 33.3, 0), run(ours, 32.0, 1), run("reference", 32.0, 1),
            run("reference", 34.0, 2), run(ours, 34.0, 2), run("project: accuracy off", 33.5)]
    rows = {r["name"]: r for r in combined(runs)}
    assert [r["name"] for r in combined(runs)] == ["reference", ours, "project: accuracy off"]
    assert rows[ours]["runs"] == 3 and rows[ours]["step_ms"] == 33.3  # the median run
    assert rows[ours]["peak_allocated_mib"] == 8034.0  # the highest
    assert rows[ours]["vs_reference"] == pytest.approx(1.0)  # median of 33.0/33.3, 1.0, 1.0
    assert rows[ours]["vs_range"] == pytest.approx([33.0 / 33.3, 1.0])
    assert "vs_range" not in rows["reference"] and rows["reference"]["vs_reference"] == pytest.approx(1.0)
    assert rows["project: accuracy off"]["vs_reference"] == pytest.approx(33.0 / 33.5)  # against the median run
    table = markdown(list(rows.values()))
    assert "| project: full_compiled, recipe defaults | 16 | 3 | 33.30 |" in table
    assert "1.000x (0.991-1.000)" in table
    single = markdown(combined([run("reference", 33.0, 0), run(ours, 33.3, 0)]))
    assert "runs" not in single and "0.991x |" in single


# NVML as nvidia-ml-py's pynvml module serves it, for a GPU drawing a steady 690 W: its energy counter in
# millijoules, an instant power reading that swings around the mean (840/440 W), and the other readings the
# sampler asks for. COUNTER = False: a GPU without the energy counter; DRIVER = False: no NVIDIA driver.
NVML_STANDIN = """
import time

NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0
COUNTER, DRIVER, WATTS = True, True, 690.0
calls = []
_begun, _reads = time.monotonic(), 0


class NVMLError(Exception):
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return {3: "Not Supported", 6: "Not Found", 9: "Driver Not Loaded"}[self.value]


def nvmlInit():
    calls.append("init")
    if not DRIVER:
        raise NVMLError(9)


def nvmlShutdown():
    calls.append("shutdown")


def nvmlDeviceGetHandleByUUID(uuid):
    if uuid != "GPU-1234":
        raise NVMLError(6)
    return uuid


def nvmlDeviceGetTotalEnergyConsumption(handle):
    if not COUNTER:
        raise NVMLError(3)
    return int(5e9 + WATTS * 1e3 * (time.monotonic() - _begun))


def nvmlDeviceGetPowerUsage(handle):
    global _reads
    _reads += 1
    return int((WATTS + (150 if _reads % 2 else -250)) * 1e3)


def nvmlDeviceGetEnforcedPowerLimit(handle):
    return 700_000


def nvmlDeviceGetClockInfo(handle, clock):
    assert clock == NVML_CLOCK_SM
    return 1740 if _reads % 2 else 1770


def nvmlDeviceGetTemperature(handle, sensor):
    assert sensor == NVML_TEMPERATURE_GPU
    return 49 + _reads % 2


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return 0x4 if _reads % 2 else 0x0
"""


@pytest.fixture
def nvml(tmp_path, monkeypatch):
    """The NVML stand-in above as the ``pynvml`` this Python imports, for one test."""
    (tmp_path / "pynvml.py").write_text(NVML_STANDIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    import pynvml

    monkeypatch.setitem(sys.modules, "pynvml", pynvml)  # gone again after the test
    return pynvml


def sampled(power, before: int = 4, until: int = 24):
    """Waits for ``before`` samples, then for ``until``: the window (start, end) between."""
    deadline = time.monotonic() + 30
    while len(power.samples) < before and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    while len(power.samples) < until and time.monotonic() < deadline:
        time.sleep(0.01)
    return start, time.monotonic()


def test_the_power_sampler_counts_the_gpus_joules_inside_the_timed_window(nvml):
    """scripts/lib/gpu_power.py reads NVML in the background: the energy over the window is the GPU's own counter
    (690 W steady here), not the instant readings (which swing around it), and the rest comes from the samples."""
    from scripts.lib.gpu_power import PowerSampler, describe

    with PowerSampler("GPU-1234", interval_ms=20) as power:
        start, end = sampled(power)
    assert nvml.calls == ["init", "shutdown"] and not power._reader.is_alive(), "NVML is let go with the sampler"
    inside = [(t, s) for t, s in power.samples if start <= t <= end]
    window = power.window(start, end, step_ms=33.0)
    assert window["samples"] == len(inside) >= 5 and window["energy_from"] == "energy counter"
    assert window["power_w"] == pytest.approx(690.0, rel=0.02)
    assert abs(statistics.median(s["power_w"] for _, s in inside) - 690.0) > 40  # the samples alone say otherwise
    assert window["energy_j"] == pytest.approx(690.0 * (inside[-1][0] - inside[0][0]), rel=0.02)
    assert window["joules_per_step"] == pytest.approx(window["power_w"] * 0.033)
    assert window["power_limit_w"] == 700.0 and window["sm_clock_mhz"] in (1740.0, 1755.0, 1770.0)
    assert 0.3 < window["power_capped_fraction"] < 0.7 and window["temperature_max_c"] == 50.0
    assert "unread" not in window
    assert "power-capped in" in describe(window) and "J a step" in describe(window)
    later = power.window(end + 1, end + 2, 33.0)  # no sample in it: only how many and why
    assert set(later) == {"samples", "why"} and later["samples"] == 0 and "fewer than 5" in later["why"]


def test_a_gpu_without_the_energy_counter_gives_the_median_of_its_power_readings(nvml):
    from scripts.lib.gpu_power import PowerSampler

    nvml.COUNTER = False
    with PowerSampler("GPU-1234", interval_ms=20) as power:
        start, end = sampled(power)
    inside = [s for t, s in power.samples if start <= t <= end]
    window = power.window(start, end, step_ms=33.0)
    assert window["energy_from"] == "power samples" and window["energy_j"] is None
    assert window["power_w"] == statistics.median(s["power_w"] for s in inside)
    assert window["unread"] == {"energy_mj": "Not Supported"}  # said, and the other readings kept


def test_without_nvml_the_power_is_not_measured_and_says_why(nvml, monkeypatch):
    from scripts.lib.gpu_power import PowerSampler, describe

    def window_of(uuid: str):
        with PowerSampler(uuid) as power:
            pass
        return power.window(0.0, 1e12, 33.0)

    assert window_of("GPU-9999") == {"samples": 0, "why": "NVML cannot find GPU-9999: Not Found"}
    nvml.DRIVER = False
    assert window_of("GPU-1234") == {"samples": 0, "why": "NVML did not start: Driver Not Loaded"}
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    window = window_of("GPU-1234")
    assert window == {"samples": 0, "why": "no NVML binding in this Python (the pynvml module): "
                                           "pip install nvidia-ml-py"}
    assert describe(window) == f"power: not measured ({window['why']})"
    with PowerSampler(None) as off:  # not asked for (the scripts' --power): no thread, no numbers
        pass
    assert off._reader is None and off.window(0.0, 1e12, 33.0) is None
    unreadable = {"samples": 9, "power_w": None, "power_limit_w": 700.0, "sm_clock_mhz": 1740.0,
                  "power_capped_fraction": None, "temperature_max_c": None, "joules_per_step": None}
    assert describe(unreadable) == "power: ? W of 700, SM 1740 MHz, ? J a step"  # a field it could not read


@pytest.mark.fast
def test_bench_float8_casts_table_keeps_the_ways_that_ran_beside_one_that_did_not():
    from scripts.bench_float8_cast import markdown

    ran = {"way": "eager", "status": "ok", "first_call_s": 0.05, "launched_ms": 1.234, "graphed_ms": 0.987,
           "bytes_as_eager": True}
    stopped = {"way": "list_dynamic", "status": "ran past 600 s: (no output)"}
    table = markdown([ran, stopped], "1b", 2).splitlines()
    assert table[0].startswith("| way (1b, a rank's shards of 2) |") and len(table) == 4
    assert table[2] == "| eager | 0.1 | 1.23 | 0.99 | True |"
    assert table[3] == "| list_dynamic | ran past 600 s: (no output) | | | |"


def test_bench_gpt2_sets_both_profiled_steps_side_by_side_and_names_the_kernels_that_differ():
    """From the two profiles of issue 50 (scripts/results/gpt2_profiled_pair.json, one H200), as bench_gpt2
    --profile writes them: the step, busy and idle time, kinds and power rows, then the kernels by difference."""
    from scripts.bench_gpt2 import PROFILED, profile_markdown
    from scripts.lib.kernel_profile import kernel_diff

    saved = json.loads((ROOT / "scripts" / "results" / "gpt2_profiled_pair.json").read_text())
    reference = {**saved["reference_profile"]["profile"], "step_ms": saved["reference_profile"]["step_ms_median"]}
    project = saved["project_profile"]
    reference, project = ({k: side.get(k) for k in PROFILED} for side in (reference, project))
    project["power"] = {"samples": 67, "power_w": 691.6, "sm_clock_mhz": 1740.0, "power_capped_fraction": 0.957,
                        "joules_per_step": 22.88}
    table = profile_markdown(reference, project, differing=4)
    assert "| GPU busy | 31.65 | 32.82 |" in table and "| kernels a step | 653 | 677 |" in table
    assert "| matmuls | 17.08 | 17.78 |" in table
    assert "| power (W, median over timed steps) | — | 692 |" in table  # the reference's run had no power then
    assert "| samples at the power cap | — | 96% |" in table and "| energy a step (J) | — | 22.88 |" in table
    differing = table.split("project - reference |")[1].strip().splitlines()[1:]
    assert len(differing) == 4
    # The loss's kernel differs in name (ours carries the top-1): each side's own is one of the largest rows.
    assert any("prepare_softmax_online" in line and "| — |" in line and "+1.2" in line for line in differing)
    assert any("_log_softmax_prepare_softmax_online" in line and line.rstrip().endswith("-1.187 |")
               for line in differing)
    rows = kernel_diff(reference["top_kernels"], project["top_kernels"], n=200)
    assert len(rows) == len({r["name"] for r in reference["top_kernels"] + project["top_kernels"]})
    same = next(r for r in rows if r["name"].startswith("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"))
    assert same["first_per_step"] == same["second_per_step"] == 49.0
    assert same["diff_ms"] == pytest.approx(same["second_ms"] - same["first_ms"])
    assert [abs(r["diff_ms"]) for r in rows] == sorted((abs(r["diff_ms"]) for r in rows), reverse=True)


def test_bench_gpt2_writes_the_references_uniform_tokens_as_files_the_recipe_trains_on(tmp_path):
    """--data uniform: the project reads uniform random ids over GPT-2's vocabulary (the reference's own data)
    from token files, through the recipe's own reader and checks."""
    import numpy as np
    import torch

    from conf.schema import compose
    from recipes.tokens import token_splits
    from scripts.bench_gpt2 import PROJECT, uniform_tokens
    from scripts.reference_gpt2 import CONTEXT, VOCAB

    overrides = uniform_tokens(tmp_path / "uniform", sequences=64)
    cfg = compose([*PROJECT, *overrides])
    assert cfg.recipe.data.source == "tokens" and cfg.recipe.data.root == str(tmp_path / "uniform")
    assert cfg.recipe.model.vocab == VOCAB and cfg.recipe.model.context == CONTEXT
    train, test = token_splits(cfg.recipe.data.root, CONTEXT, VOCAB)
    assert len(train) == 64 and len(test) == 16
    ids = np.fromfile(tmp_path / "uniform" / "train.bin", dtype=np.uint16)
    assert ids.max() < VOCAB and ids.max() > VOCAB - 100 and len(np.unique(ids)) > 0.7 * VOCAB  # the whole range
    sixteenths = np.bincount(ids.astype(np.int64) * 16 // VOCAB, minlength=16)  # flat: each sixteenth of the range alike (4,096 +- 64)
    assert np.abs(sixteenths / sixteenths.mean() - 1).max() < 0.1, sixteenths
    x, y = train[3]
    assert torch.equal(x[1:].long(), y[:-1])


def test_bench_gpt2_refuses_data_settings_that_data_uniform_sets_itself(tmp_path):
    proc = script("bench_gpt2.py", "--data", "uniform", "recipe.data.source=synthetic", timeout=120)
    assert proc.returncode == 2 and "--data uniform sets recipe.data.source" in proc.stderr, proc.stderr[-2000:]
