"""graphing keeps its word as a library: every public name stays importable, renamed names keep a
deprecated alias that warns once, and the version is one number (graphing.__version__, which
pyproject.toml reads). CHANGELOG.md lists every change to the public names."""
from __future__ import annotations

import ast
import importlib
import re
import warnings

import pytest
import torch

import graphing
from helpers.paths import ROOT
from test_graphing import _linear_step as linear_step

pytestmark = pytest.mark.fast


def test_every_name_in_all_is_importable_and_visible_to_tools():
    for name in graphing.__all__:
        assert getattr(graphing, name) is not None, name
        exec(f"from graphing import {name}", {})
    # The lazily loaded names are imported under TYPE_CHECKING too (tools and go-to-definition),
    # from the same modules the lazy table names.
    tree = ast.parse((ROOT / "graphing" / "__init__.py").read_text())
    typed = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                typed.update({alias.name: imp.module for alias in imp.names})
    lazy = graphing._LAZY
    assert set(typed) == set(lazy)
    for name, module in lazy.items():
        assert getattr(importlib.import_module(typed[name]), name) is getattr(importlib.import_module(module), name)


def test_the_version_is_one_number_and_the_changelog_has_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+", graphing.__version__)
    assert 'version = {attr = "graphing.__version__"}' in (ROOT / "pyproject.toml").read_text()
    assert f"## {graphing.__version__} " in (ROOT / "CHANGELOG.md").read_text()


def test_graphed_step_info_still_returns_its_dict_from_report_and_warns_once(monkeypatch):
    from graphing import deprecation

    monkeypatch.setattr(deprecation, "_warned", set())
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = graphing.GraphedStep(linear_step(optimizer), model, optimizer, mode="eager")
    step(torch.randn(8, 4), torch.randn(8, 1))
    with pytest.warns(DeprecationWarning, match=r"GraphedStep.info is deprecated: use GraphedStep.report"):
        info = step.info
    assert info == {"mode": step.report.mode, "capture_error_mode": step.report.capture_error_mode}
    assert info["mode"] == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second read is silent
        assert step.info == info
    step.close()



def test_the_full_modes_old_executor_name_still_works_and_warns_once(monkeypatch):
    import graphing.full
    from graphing import deprecation

    monkeypatch.setattr(deprecation, "_warned", set())
    with pytest.warns(DeprecationWarning, match=r"graphing.full.WholeStepGraphExecutor is deprecated: use "
                                                r"graphing.full.FullGraphExecutor"):
        assert graphing.full.WholeStepGraphExecutor is graphing.full.FullGraphExecutor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graphing.full.WholeStepGraphExecutor is graphing.full.FullGraphExecutor  # once per process
    with pytest.raises(AttributeError):
        graphing.full.NoSuchExecutor
