"""Hydra multirun: `python train.py -m key=a,b` runs every job into its own sweep folder,
reports a job that fails while running, goes on, and ends with one table."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.launches import launch


@pytest.mark.skipif(torch.cuda.is_available(), reason="uses graph=full failing without CUDA")
def test_a_sweep_reports_a_failing_job_goes_on_and_ends_with_one_table(tmp_path):
    sweep = tmp_path / "sweep"
    done = launch(["-m", "graph=full,eager", "experiment=debug", "logger=none", f"hydra.sweep.dir={sweep}"],
                  timeout=180, log_dir=tmp_path / "logs")
    text = done.stdout + done.stderr
    assert done.returncode == 1, text[-3000:]  # one job failed
    assert text.count("graph.mode=full needs a CUDA GPU") == 1
    # The failing job came first; the eager job still ran, into Hydra's job folder 1.
    results = json.loads((sweep / "1" / "results.json").read_text())
    assert results["mode"] == "eager" and results["steps"] == 20
    table = text.split("sweep:\n", 1)[1]
    assert "| graph=full experiment=debug logger=none | failed (exit 2) |" in table
    assert "| graph=eager experiment=debug logger=none | ok | eager |" in table and f"| {sweep / '1'} |" in table
    assert "1 of 2 jobs failed" in text
