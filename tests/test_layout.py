"""The house as a reader meets it: trainer/'s rooms by concern (docs/layout.md), the short road from
train.py to the optimizer's step, and the old module names that still import (CHANGELOG.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from helpers.launches import launch
from helpers.paths import ROOT

MOST_FILES_TO_THE_OPTIMIZER = 6  # a reader follows one step through this many files of the repo at most

_RECORD_STACK = textwrap.dedent("""
    import json, os, traceback
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def _record(optimizer, args, kwargs):
        path = os.environ["STACK_RECORD"]
        if not os.path.exists(path):
            with open(path, "w") as f:
                json.dump([(frame.filename, frame.name) for frame in traceback.extract_stack()], f)

    register_optimizer_step_pre_hook(_record)
""")


def test_from_train_py_to_the_optimizer_step_a_reader_crosses_few_files(tmp_path):
    # The optimizer step's call stack in a graph=eager run of train.py, as traceback.extract_stack() sees it from
    # an optimizer step hook (a sitecustomize loaded ahead of train.py registers it).
    hook_dir, record = tmp_path / "hook", tmp_path / "stack.json"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(_RECORD_STACK)
    path = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH")) if p)
    run = launch(["experiment=debug", "graph=eager", "logger=none", "train.max_steps=1"], tmp_path / "outputs",
                 env={"PYTHONPATH": path, "STACK_RECORD": str(record)})
    assert run.returncode == 0, run.stderr[-3000:]
    frames = json.loads(record.read_text())
    ours = []
    for filename, _ in frames:
        inside = os.path.abspath(filename).startswith(str(ROOT) + os.sep) and "site-packages" not in filename
        if inside and os.path.relpath(filename, ROOT) not in ours:
            ours.append(os.path.relpath(filename, ROOT))
    assert ours[0] == "train.py" and ours[-1] == os.path.join("trainer", "step", "steps.py"), ours
    assert len(ours) <= MOST_FILES_TO_THE_OPTIMIZER, f"{len(ours)} files from train.py to optimizer.step(): {ours}"


def test_a_moved_module_imports_by_its_old_name_as_the_same_module_with_a_warning_naming_the_new():
    code = textwrap.dedent("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from trainer.errors import ConfigError
            import trainer.schedules
        import trainer.run.errors, trainer.step.schedules
        assert ConfigError is trainer.run.errors.ConfigError
        assert trainer.schedules is trainer.step.schedules
        assert trainer.step.schedules.__spec__.name == "trainer.step.schedules"
        print("\\n".join(f"{w.category.__name__}: {w.message}" for w in caught))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "FutureWarning: trainer.errors is now trainer.run.errors" in done.stdout, done.stdout
    assert "FutureWarning: trainer.schedules is now trainer.step.schedules" in done.stdout, done.stdout


@pytest.mark.fast
def test_a_config_that_names_a_schedule_by_its_old_module_still_builds_it():
    from hydra.utils import get_class

    from trainer.step.schedules import Cosine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert get_class("trainer.schedules.Cosine") is Cosine
