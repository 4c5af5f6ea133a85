"""What every benchmark's table holds (issue 67): both sides of a comparison timed by one wall window, each row
with the commit, versions and GPU it was measured with, ``--append`` refusing another commit's table, and a run
that fails or runs past its time marked in its row while the other rows are still written.

The sides run on the CPU: this repo's trainer in this process (train.py's session), the yardsticks' loop through
scripts/lib/timing.py with a stand-in step, and bench_float8.py with a stand-in for train.py that writes what a run
writes (results.json, metrics.jsonl) or fails or hangs as told.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.paths import ROOT

READ_S = 0.2  # what each stand-in metric read costs the host


def test_a_metric_reads_host_time_counts_in_this_repos_wall_window_and_not_in_its_step_times(tmp_path):
    """train.py's loop restarts the step timer after each metric read: the step times leave the read out, the
    wall window (perf/wall_*) holds every read between its first and last timed step."""
    from conf.schema import compose
    from trainer.metrics.logger import MetricsLogger
    from trainer.session import Session

    class SlowReads(MetricsLogger):  # this repo's logger, its every log costing READ_S of host time
        def log(self, metrics, step):
            time.sleep(READ_S)
            super().log(metrics, step)

    cfg = compose(["recipe.data.source=synthetic", "recipe.data.train_size=512", "recipe.data.test_size=64",
                   "logger=none", "train.progress=false", "train.eval=false", "checkpoint.save=false",
                   "graph=eager", "graph.warmup_iters=2", "train.max_steps=8", "train.log_every=1",
                   f"output_root={tmp_path}"])
    summaries = []

    def job(session):
        trainer = session.build()
        logger = SlowReads(cfg.logger, trainer.rt.run_dir, {}, rank=0, job_type="", enabled=False)
        summaries.append(trainer.fit(logger))
        return 0

    assert Session(cfg).execute(job) == 0
    s = summaries[0]
    assert s["timed_phase"] == "eager" and s["perf/steps_timed"] == s["perf/wall_steps"] == 6  # 8 - 2 warm-up
    steps_s = s["perf/steps_timed"] * s["perf/step_ms_mean"] / 1e3
    # The window: the 6 steps and the 5 reads between them (the last step's read comes after its end); were a
    # read inside a step's time, the window would hold hardly more than the steps.
    assert s["perf/wall_s"] >= steps_s + 5 * READ_S, s
    samples = 6 * cfg.recipe.data.batch_size
    assert s["perf/wall_samples_per_s"] == pytest.approx(samples / s["perf/wall_s"])
    assert s["perf/wall_samples_per_s_per_gpu"] == s["perf/wall_samples_per_s"]  # one process


class StandInSteps:
    """A yardstick's loop as scripts/lib/timing.py times it (the torchtitan worker's Steps, reference_gpt2's):
    each step ``step_s`` of host time, each metric read READ_S."""

    def __init__(self, step_s: float):
        import torch

        self.device, self.step_s, self.reads = torch.device("cpu"), step_s, []
        self.taken = 0

    def next_step(self) -> None:
        time.sleep(self.step_s)
        self.taken += 1

    def read_metrics(self) -> None:
        time.sleep(READ_S)
        self.reads.append(self.taken)


def test_a_yardsticks_metric_read_counts_in_its_wall_window_as_in_this_repos():
    """scripts/lib/timing.py times the other side with this repo's Perf: the same step times (a read left out)
    and the same wall window (every read between the first and last timed step in it), reads at the cadence of
    train.log_every, warm-up steps counted."""
    from scripts.lib.timing import time_steps

    steps = StandInSteps(step_s=0.02)
    timed = time_steps(steps, 6, warmup=2, log_every=2, read_metrics=steps.read_metrics)
    assert steps.taken == 8 and steps.reads == [2, 4, 6, 8]  # every 2nd step, from the first warm-up step
    assert timed["steps_timed"] == timed["wall_steps"] == 6
    # Timed steps 3..8: the reads after steps 4 and 6 lie inside the window; 2's before it, 8's after it.
    assert timed["wall_s"] >= 6 * 0.02 + 2 * READ_S
    assert timed["wall_s"] >= timed["steps_timed"] * timed["step_ms_mean"] / 1e3 + 2 * READ_S  # steps leave reads out
    assert timed["step_ms_median"] >= 20
    every = StandInSteps(step_s=0.02)
    assert time_steps(every, 3, log_every=1, read_metrics=every.read_metrics)["wall_s"] >= 3 * 0.02 + 2 * READ_S
    quiet = time_steps(StandInSteps(step_s=0.02), 3)  # no reads (profile_step.py, bench_input.py)
    assert quiet["wall_steps"] == 3 and quiet["wall_s"] >= 0.06


def test_the_torchtitan_worker_reads_the_mean_loss_since_its_last_read():
    """Its read is what torchtitan's trainer does at its log step: the steps' mean loss on the host."""
    import torch

    from scripts.lib.torchtitan_worker import Steps

    steps = Steps(*[None] * 8, data=[], device=torch.device("cpu"))
    steps.losses += [torch.tensor(1.0), torch.tensor(3.0)]
    steps.read_metrics()
    steps.losses += [torch.tensor(5.0)]
    steps.read_metrics()
    assert steps.logged == [(2, 2.0), (3, 5.0)]


# ---- the rows: provenance, --append, failed runs -------------------------------------------------

def head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


STAND_IN_TRAIN = textwrap.dedent("""\
    # train.py as bench_float8.py launches it: writes a run's results.json and metrics.jsonl into run_dir, unless
    # told (by its mode and float8 recipe) to fail or to hang
    import json, pathlib, sys, time
    given = dict(arg.split("=", 1) for arg in sys.argv[1:] if "=" in arg)
    what = (given["graph"], given["train.float8"])
    if what == ("eager", "rowwise"):
        time.sleep(120)  # past bench_float8's --timeout
    if what == ("full", "none"):
        print("RuntimeError: the stand-in's bf16 run fails", file=sys.stderr)
        sys.exit(3)
    tokens = {"none": 1000.0, "tensorwise": 1250.0, "rowwise": 1100.0}[given["train.float8"]]
    run_dir = pathlib.Path(given["run_dir"])
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps({
        "perf/wall_tokens_per_s_per_gpu": tokens, "perf/step_ms_median": 8.0, "perf/peak_reserved_mib": 2048.0}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 4.0}) + "\\n"
                                                   for s in range(1, 4)))
    """)


def test_a_failed_and_a_timed_out_run_are_marked_and_every_other_row_is_written(tmp_path, monkeypatch, capsys):
    """bench_float8.py once wrote no table when its rowwise run passed its timeout: the bf16 and tensorwise rows
    were lost. Now each run that fails or hangs is marked in its row, the others run and are written, the rows
    record the commit and versions, and the script exits 1."""
    import torch

    import scripts.bench_float8 as bench_float8

    stand_in = tmp_path / "train_stand_in.py"
    stand_in.write_text(STAND_IN_TRAIN)
    monkeypatch.setattr(bench_float8, "train_launcher", lambda nproc: [sys.executable, str(stand_in)])
    monkeypatch.setattr(bench_float8, "gpu_name", lambda: "stand-in GPU")
    output = tmp_path / "float8.json"
    code = bench_float8.main(["--modes", "eager,full", "--float8", "tensorwise,rowwise", "--steps", "3",
                              "--timeout", "5", "--output", str(output), "recipe=gpt_tiny"])
    captured = capsys.readouterr()
    assert code == 1
    saved = json.loads(output.read_text())
    rows = {(row["mode"], row["float8"]): row for row in saved["rows"]}
    assert list(rows) == [(m, f) for m in ("eager", "full") for f in ("bf16", "tensorwise", "rowwise")]
    assert rows["eager", "rowwise"]["status"].startswith("ran past 5 s")
    assert rows["full", "bf16"]["status"] == "failed (3): RuntimeError: the stand-in's bf16 run fails"
    assert rows["eager", "tensorwise"]["status"] == "ok" and rows["eager", "tensorwise"]["over_bf16"] == 1.25
    assert rows["full", "tensorwise"]["tokens_per_s_per_gpu"] == 1250.0
    assert rows["full", "tensorwise"]["over_bf16"] is None  # its bf16 run failed: no ratio
    assert rows["eager", "rowwise"]["tokens_per_s_per_gpu"] is None
    commit = rows["eager", "bf16"]["provenance"]["commit"]
    assert commit.removesuffix("+modified") == head()
    for row in saved["rows"]:  # every row, the failed ones too
        assert row["provenance"]["commit"] == commit and row["provenance"]["torch"] == torch.__version__
        assert row["provenance"]["gpu"] == "stand-in GPU" and "torchao" in row["provenance"]
    table = output.with_suffix(".md").read_text()
    assert "| eager | rowwise | — | — | — | — | — | — | ran past 5 s" in table
    assert "| full | bf16 | — |" in table and "| eager | tensorwise | 1,250 | 1.250x |" in table
    assert f"Measured at commit {commit} with torch {torch.__version__}" in table
    assert "bench_float8.py: eager, rowwise: ran past 5 s" in captured.err
    assert "bench_float8.py: full, bf16: failed (3)" in captured.err


@pytest.mark.fast
def test_append_refuses_a_table_of_another_commit_or_versions(tmp_path, capsys):
    """bench_torchtitan.py --append keeps an earlier call's rows only when they were measured at this commit with
    these versions; otherwise one line, exit 2, before anything runs (here --dry-run, which checks as a real call
    does)."""
    import scripts.bench_torchtitan as bench
    from scripts.lib.comparison import provenance

    here = provenance(None)
    output = tmp_path / "torchtitan_2gpu.json"
    row = {"run": "torchtitan eager", "size": "1b", "nproc": 2, "seq_len": 8192, "local_batch": 1, "ac": "none",
           "status": "ok", "provenance": {**here, "gpu": "NVIDIA H200"}}
    argv = ["--dry-run", "--nproc", "2", "--size", "1b", "--append", "--output", str(output)]
    output.write_text(json.dumps({"rows": [row]}))
    assert bench.main(argv) == 0
    assert "after the 1 rows it holds (--append)" in capsys.readouterr().out
    for key, other in (("commit", "0" * 40), ("torch", "2.11.0"), ("torchao", "0.16.0")):
        output.write_text(json.dumps({"rows": [row, dict(row, provenance={**row["provenance"], key: other})]}))
        with pytest.raises(SystemExit) as refused:
            bench.main(argv)
        err = capsys.readouterr().err
        assert refused.value.code == 2 and err.count("\n") == 1, err
        assert f"--append: {output} holds rows measured with {key} {other} (now {here[key]})" in err
        assert "give another --output, or drop --append" in err
    output.write_text(json.dumps({"rows": [{k: v for k, v in row.items() if k != "provenance"}]}))
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert "no commit or versions (written before rows recorded them)" in capsys.readouterr().err


@pytest.mark.fast
def test_bench_gpt2_marks_a_failed_run_and_takes_the_ratio_from_the_wall_windows():
    from scripts.bench_gpt2 import combined, markdown

    def run(name, tokens, step_ms, repeat, status="ok"):
        ok = status == "ok"
        return {"name": name, "batch_size": 16, "status": status, "step_ms": step_ms if ok else None,
                "tokens_per_s": tokens if ok else None, "mfu_pct": None, "peak_allocated_mib": None, "wall_s": 60.0,
                "command": name, "repeat": repeat}

    ours = "project: full_compiled, recipe defaults"
    # The project's median step is the shorter, but its wall window holds more: the ratio is the windows'.
    runs = [run("reference", 500_000.0, 33.0, 0), run(ours, 480_000.0, 32.5, 0),
            run("reference", 0, 0, 1, status="ran past 900 s: stopped"), run(ours, 490_000.0, 32.4, 1)]
    rows = {r["name"]: r for r in combined(runs)}
    assert rows[ours]["vs_reference"] == pytest.approx(485_000 / 500_000)  # over the reference's median run
    assert rows[ours]["tokens_per_s"] == 485_000.0 and rows[ours]["status"] == "ok"
    assert rows["reference"]["status"] == "1 of 2 ok; ran past 900 s: stopped"
    assert rows["reference"]["tokens_per_s"] == 500_000.0  # the failed run counts in no number
    table = markdown(list(rows.values()))
    assert "| reference | 16 | 2 | 33.00 | 500,000 |" in table and "1 of 2 ok; ran past 900 s" in table
    failed = combined([run("reference", 0, 0, 0, status="failed (1): boom"), run(ours, 480_000.0, 32.5, 0)])
    assert failed[0]["tokens_per_s"] is None and "vs_reference" not in failed[1]
    assert "| reference | 16 | — | — | — |" in markdown(failed)


@pytest.mark.gpu
def test_on_cuda_the_wall_window_is_the_devices_time_from_the_first_step_to_the_last_with_reads_in_it():
    """On CUDA both ends are events on the device's clock: a host read that keeps the GPU waiting counts, with no
    host sync added in the loop; a step's own time (its kernels) stays out of the reads."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from scripts.lib.timing import time_steps

    class MatmulSteps:
        def __init__(self):
            self.device = torch.device("cuda")
            self.x = torch.randn(2048, 2048, device=self.device)

        def next_step(self) -> None:
            for _ in range(8):
                self.x = torch.tanh(self.x @ self.x)

        def read_metrics(self) -> None:
            float(self.x.sum())  # a host sync, as a metric read is
            time.sleep(READ_S)

    steps = MatmulSteps()
    timed = time_steps(steps, 6, warmup=3, log_every=1, read_metrics=steps.read_metrics)
    assert timed["wall_steps"] == 6
    assert timed["wall_s"] >= timed["steps_timed"] * timed["step_ms_mean"] / 1e3 + 5 * READ_S * 0.99
    quiet = time_steps(MatmulSteps(), 6, warmup=3)  # no reads: the window is the steps back to back
    assert quiet["wall_s"] == pytest.approx(6 * quiet["step_ms_mean"] / 1e3, rel=0.05)
