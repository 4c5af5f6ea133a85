"""`graphing` installs as a library (pyproject.toml): `pip install .` and `pip install -e .` put the
graphing package, and nothing else of this repo, into a fresh virtualenv, offline, with torch as
its only requirement; `import graphing` then works from any directory.

Each test copies the checkout (git's tracked and not-ignored files) into tmp_path and installs
from the copy, so the checkout itself is never built in. What the build leaves in the copy must
be ignored by this repo's .gitignore. The fresh virtualenv reaches this interpreter's
site-packages (torch, pip, setuptools) through a .pth file: `venv --system-site-packages` would
not, when pytest itself runs from a virtualenv (it sees the base interpreter's site-packages).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import venv
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run by the new virtualenv's python, from a directory outside the checkout.
PROBE = """
import importlib.metadata, importlib.util, json, sys, sysconfig
import graphing
import graphing.doctor
graphing.GraphedStep
dist = importlib.metadata.distribution("graphing")
print(json.dumps({
    "graphing": graphing.__file__,
    "doctor": graphing.doctor.__file__,
    "purelib": sysconfig.get_path("purelib"),
    "files": [str(f) for f in dist.files],
    "requires": dist.requires,
    "version": dist.version,
    "importable": {name: importlib.util.find_spec(name) is not None for name in ("trainer", "recipes", "train")},
}))
"""


def cannot_install() -> str:
    """Why these tests cannot install offline (--no-build-isolation) from here, or ''."""
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse"],
                                                      capture_output=True).returncode != 0:
        return "not a git checkout (the tests copy git's files and ask git what is ignored)"
    if importlib.util.find_spec("pip") is None:
        return "pip is not installed"
    spec = importlib.util.find_spec("setuptools")
    if spec is None:
        return "setuptools (the build backend) is not installed"
    # setuptools >= 70.1 builds wheels by itself; older ones need the `wheel` package as well.
    if not (Path(spec.origin).parent / "command" / "bdist_wheel.py").exists() \
            and importlib.util.find_spec("wheel") is None:
        return "this setuptools is older than 70.1 and `wheel` is not installed"
    return ""


WHY_NOT = cannot_install()
needs_offline_install = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-")


def checkout_files() -> List[str]:
    """The checkout's files as git sees them: tracked, plus untracked ones .gitignore does not ignore."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def copy_checkout(dest: Path) -> List[str]:
    files = checkout_files()
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    return files


def not_ignored(paths: List[str]) -> List[str]:
    """Those of ``paths`` (relative to the repo root) that this repo's ignore rules do not ignore."""
    if not paths:
        return []
    proc = subprocess.run(["git", "-c", f"core.excludesFile={os.devnull}", "-C", str(ROOT), "check-ignore",
                           "--no-index", "--stdin"], input="\n".join(paths) + "\n", capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr
    return sorted(set(paths) - set(proc.stdout.splitlines()))


def fresh_venv(where: Path) -> Path:
    """A virtualenv without pip or anything else of its own; it reaches this interpreter's
    site-packages (torch, pip, setuptools) through a .pth file. Returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(where)
    python = where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    for name in ("torch", "pip", "setuptools"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.append(str(Path(spec.origin).parent.parent))
    dirs = [d for d in dict.fromkeys(dirs) if os.path.isdir(d) and Path(d).resolve() != ROOT]
    (Path(purelib) / "_parent_site_packages.pth").write_text("\n".join(dirs) + "\n")
    return python


def clean_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    env.update(PYTHONNOUSERSITE="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_INPUT="1", PIP_ROOT_USER_ACTION="ignore")
    return env


def install(tmp_path: Path, *, editable: bool) -> Tuple[Dict, Path, List[str]]:
    """Copies the checkout, installs it into a fresh virtualenv (offline, no build isolation, no
    dependencies), and probes that virtualenv from outside the checkout. Returns (the probe's
    answer, the copy, what the build left in the copy that is not ignored by .gitignore)."""
    src = tmp_path / "checkout"
    copied = set(copy_checkout(src))
    python = fresh_venv(tmp_path / "venv")
    env = clean_env()
    cmd = [str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index", "--no-deps",
           "--no-compile", *(["-e"] if editable else []), str(src)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    left = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()]
    unignored = not_ignored([f for f in left if f not in copied])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([str(python), "-c", PROBE], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), src, unignored


def graphing_modules() -> List[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "graphing").rglob("*.py"))


@needs_offline_install
def test_pip_install_puts_graphing_alone_into_site_packages(tmp_path):
    probe, src, unignored = install(tmp_path, editable=False)

    purelib = Path(probe["purelib"]).resolve()
    assert Path(probe["graphing"]).resolve() == purelib / "graphing" / "__init__.py", probe["graphing"]
    assert Path(probe["doctor"]).resolve() == purelib / "graphing" / "doctor" / "__init__.py"
    assert not Path(probe["graphing"]).resolve().is_relative_to(src.resolve())
    assert not any(probe["importable"].values()), probe["importable"]
    # Nothing but the graphing package (every module of it) and its metadata.
    files = [f for f in probe["files"] if "__pycache__" not in f]
    assert {f.split("/")[0] for f in files} == {"graphing", f"graphing-{probe['version']}.dist-info"}, files
    assert sorted(f for f in files if f.endswith(".py")) == graphing_modules()
    assert [re.split(r"[<>=!~ ;\[]", r)[0] for r in probe["requires"]] == ["torch"], probe["requires"]
    assert probe["version"] == re.search(r'__version__ = "([^"]+)"', (ROOT / "graphing" / "__init__.py").read_text())[1]
    assert not unignored, f"the build left files that .gitignore does not ignore: {unignored}"


@needs_offline_install
def test_editable_install_imports_graphing_from_the_checkout(tmp_path):
    probe, src, unignored = install(tmp_path, editable=True)

    assert Path(probe["graphing"]).resolve() == (src / "graphing" / "__init__.py").resolve(), probe["graphing"]
    assert not any(probe["importable"].values()), probe["importable"]
    assert [re.split(r"[<>=!~ ;\[]", r)[0] for r in probe["requires"]] == ["torch"], probe["requires"]
    assert not unignored, f"the build left files that .gitignore does not ignore: {unignored}"


@pytest.mark.fast
def test_pyproject_requires_the_torch_range_of_requirements_txt():
    """graphing's one requirement is the torch range requirements.txt pins (graphing/compat.py's range)."""
    torch_line = next(line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
                      if re.match(r"torch\s*[<>=!~]", line))
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert deps, "pyproject.toml has no [project] dependencies"
    assert re.findall(r'"([^"]*)"', deps.group(1)) == [torch_line]
