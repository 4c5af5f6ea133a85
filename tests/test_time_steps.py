"""scripts/time_steps.py: any training script timed by its optimizer steps, the script unmodified."""
from __future__ import annotations

import json
import subprocess
import sys

from helpers.paths import ROOT

LOOP = '''import sys
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(int(sys.argv[1])):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("the loop finished")
'''


def run(tmp_path, steps_in_script: int, *options: str):
    (tmp_path / "loop.py").write_text(LOOP)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "time_steps.py"), *options, "--batch", "8",
                           "--output", str(tmp_path / "window.json"), str(tmp_path / "loop.py"), str(steps_in_script)],
                          capture_output=True, text=True, timeout=120)


def test_the_window_of_optimizer_steps_is_written_and_the_script_ends_there(tmp_path):
    done = run(tmp_path, 1000, "--skip", "3", "--steps", "5")
    assert done.returncode == 0, done.stderr
    window = json.loads((tmp_path / "window.json").read_text())
    assert (window["steps"], window["skipped"], window["batch"]) == (5, 3, 8)
    assert window["samples_per_s"] == 5 * 8 / window["wall_s"] > 0
    assert "the loop finished" not in done.stdout  # ended at the window's end, not after 1000 steps


def test_a_script_that_ends_before_the_window_closes_writes_nothing_and_exits_1(tmp_path):
    done = run(tmp_path, 6, "--skip", "3", "--steps", "5")
    assert done.returncode == 1 and "the loop finished" in done.stdout
    assert "loop.py returned before its window of 5 steps after 3 closed" in done.stderr
    assert not (tmp_path / "window.json").exists()
