"""A user copies commands from README.md and docs/*.md: the ones marked runnable work, and
every relative link leads to a file (and a heading, when it names one).

Marker convention: the fence's info string.

    ```bash cpu     runs on a machine without a GPU, exactly as written
    ```bash gpu     needs a GPU machine
    ```bash         not checked: it needs your files, your package, a cluster or the network

Nothing is trained here; each command line of a marked block is checked by what it asks for:

- ``python train.py ARGS`` and ``torchrun [OPTIONS] train.py ARGS``: ARGS are composed in this
  process with Hydra's compose API (what ``python train.py ARGS --cfg job`` prints; every job
  of a ``-m`` sweep), and torchrun's options are parsed by torchrun's own parser. In a ``cpu``
  block the composed config must also pass the run's plan on the CPU, with the process count
  torchrun asks for: ``graph=full`` or ``train.precision=fp16`` in a ``cpu`` block fail here.
- ``python scripts/X.py ARGS`` (or under torchrun): the script runs (in this process) with
  ``--help`` appended to its own options (before ``--``), which parses their values and must
  exit 0; every ``--option`` named must be in its help; a script that takes train.py's config
  gets its overrides composed as above.
- ``pip install -r FILE``: this environment satisfies FILE; an optional extra's FILE (helpers.availability's
  ``EXTRAS``) that is not installed skips its block, naming the package and the command (marked
  ``extras``). ``pytest -m EXPR``: every marker in EXPR is registered.

Any other command in a marked block fails: teach this file to check it, or leave the block
unmarked. Continuation lines (``\\``) are joined, ``# comments`` dropped, ``&&`` splits commands.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from helpers.availability import EXTRAS
from helpers.paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = ("cpu", "gpu")
FENCE = re.compile(r"^\s*```(.*)$")
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-dir", "-cd", "--config-name", "-cn"}
HYDRA_FLAGS = {"-m", "--multirun"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    mark: Optional[str]  # "cpu", "gpu" or None
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> List[Block]:
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{i + 1}: a fence that is never closed"
        info = opening.group(1).strip()
        words = info.split()
        mark = words[1] if len(words) > 1 and words[0] == "bash" else None
        blocks.append(Block(path, i + 1, mark, info, "\n".join(lines[i + 1:end])))
        i = end + 1
    return blocks


def marked_blocks() -> List[Block]:
    return [b for path in DOCS for b in fenced_blocks(path) if b.mark is not None]


def commands(text: str) -> List[List[str]]:
    """The block's commands as argument lists: continuations joined, comments dropped, split at ``&&``."""
    out: List[List[str]] = []
    for line in text.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line)
        tokens = tokens[:next((k for k, t in enumerate(tokens) if t.startswith("#")), len(tokens))]
        while tokens:
            cut = tokens.index("&&") if "&&" in tokens else len(tokens)
            out.append(tokens[:cut])
            tokens = tokens[cut + 1:]
    return [c for c in out if c]


# --- what each kind of command is checked by --------------------------------------------------

class Checker:
    """Checks commands; ``check`` returns a list of problems (empty: the command works)."""

    def __init__(self, markers: List[str]):
        self.markers = markers
        self._help: Dict[Tuple[str, ...], Tuple[int, str]] = {}

    def check(self, tokens: List[str], mark: str) -> List[str]:
        program, args = tokens[0], tokens[1:]
        if program in ("python", "python3"):
            if args[:2] == ["-m", "torch.distributed.run"]:
                return self.torchrun(args[2:], mark)
            if not args:
                return ["a bare `python`: nothing to check"]
            return self.entry(args[0], args[1:], mark, world_size=1)
        if program == "torchrun":
            return self.torchrun(args, mark)
        if program == "pip":
            return self.pip(args)
        if program == "pytest":
            return self.pytest(args)
        return [f"`{program}`: this test cannot check it; leave the block unmarked or teach tests/test_docs.py"]

    def entry(self, script: str, args: List[str], mark: str, world_size: int) -> List[str]:
        if script == "train.py":
            return self.train(args, cpu_world_size=world_size if mark == "cpu" else None)
        if script.startswith("scripts/") and script.endswith(".py"):
            return self.script(script, args)
        return [f"`{script}`: not train.py or scripts/*.py"]

    def torchrun(self, args: List[str], mark: str) -> List[str]:
        from torch.distributed.run import get_args_parser

        try:
            with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage: the problem below says it
                parsed = get_args_parser().parse_args(args)
        except SystemExit:
            return [f"torchrun refuses its options: {' '.join(args)}"]
        nodes = int(str(parsed.nnodes).split(":")[-1])
        world_size = int(parsed.nproc_per_node) * nodes
        return self.entry(parsed.training_script, parsed.training_script_args, mark, world_size)

    def train(self, args: List[str], cpu_world_size: Optional[int]) -> List[str]:
        """Composes every job of the command line; with ``cpu_world_size``, plans each on the CPU too."""
        overrides, config_dir, config_name, multirun = [], None, "train", False
        i = 0
        while i < len(args):
            arg = args[i]
            if arg in HYDRA_FLAGS:
                multirun = True
            elif arg in HYDRA_FLAGS_WITH_VALUE:
                if i + 1 == len(args):
                    return [f"train.py: {arg} without a value"]
                if arg in ("--config-dir", "-cd"):
                    config_dir = str(ROOT / args[i + 1])
                elif arg in ("--config-name", "-cn"):
                    config_name = args[i + 1]
                i += 1
            elif arg.startswith("-"):
                return [f"train.py: unknown flag {arg}"]
            else:
                overrides.append(arg)
            i += 1
        jobs = sweep_jobs(overrides) if multirun else [overrides]
        return [problem for job in jobs for problem in compose_problems(job, config_dir, config_name, cpu_world_size)]

    def script(self, script: str, args: List[str]) -> List[str]:
        if not (ROOT / script).is_file():
            return [f"{script} does not exist"]
        own, train_part = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
        code, help_text = self.help(script, tuple(own))
        if code != 0:
            return [f"{script} {' '.join(own)} --help exits {code}: {help_text.strip()[-500:]}"]
        problems = [f"{script}: option {flag} is not in its --help" for flag in option_names(own)
                    if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text)]
        if "--config-dir" in help_text:  # it takes train.py's config (trainer/run/cli.py)
            train_args = [a for a in own if "=" in a and not a.startswith("-")] + train_part
            problems += self.train(train_args, cpu_world_size=None)  # the script adds its own settings
        return problems

    def help(self, script: str, own: Tuple[str, ...]) -> Tuple[int, str]:
        """``python script *own --help``, run in this process (runpy): the exit code and what it printed.

        In process, because a subprocess per command would import torch again for scripts that
        import it at the top; every script parses its command line before it does any work.
        """
        key = (script, *own)
        if key not in self._help:
            printed, saved_argv, code = io.StringIO(), sys.argv, None
            sys.argv = [str(ROOT / script), *own, "--help"]
            try:
                with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                    runpy.run_path(str(ROOT / script), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            finally:
                sys.argv = saved_argv
            if code is None:
                code, printed = 1, io.StringIO("it did not stop at --help: it ran")
            self._help[key] = (code, printed.getvalue())
        return self._help[key]

    def pip(self, args: List[str]) -> List[str]:
        if args[:2] != ["install", "-r"] or len(args) != 3:
            return [f"pip {' '.join(args)}: only `pip install -r FILE` is checked"]
        from importlib.metadata import PackageNotFoundError, version
        from packaging.requirements import Requirement

        file = ROOT / args[2]
        if not file.is_file():
            return [f"{args[2]} does not exist"]
        problems, missing = [], []
        for line in file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            requirement = Requirement(line)
            try:
                installed = version(requirement.name)
            except PackageNotFoundError:
                missing.append(requirement.name)
                problems.append(f"{args[2]}: {requirement.name} is not installed")
                continue
            if not requirement.specifier.contains(installed, prereleases=True):
                problems.append(f"{args[2]}: {requirement} but {installed} is installed")
        if missing and args[2] in EXTRAS.values():  # an optional extra the README's set-up does not install
            pytest.skip(f"needs the optional {', '.join(missing)}: pip install -r {args[2]}")
        return problems

    def pytest(self, args: List[str]) -> List[str]:
        problems, i = [], 0
        while i < len(args):
            if args[i] == "-m" and i + 1 < len(args):
                names = set(re.findall(r"[A-Za-z_]\w*", args[i + 1])) - {"and", "or", "not"}
                problems += [f"pytest -m: no marker {name!r} is registered" for name in sorted(names - set(self.markers))]
                i += 2
            elif args[i].startswith("-"):
                i += 1  # pytest's own options (--durations=0, -x, ...)
            else:
                if not (ROOT / args[i].split("::")[0]).exists():
                    problems.append(f"pytest {args[i]}: no such path")
                i += 1
        return problems


def option_names(args: List[str] | Tuple[str, ...]) -> List[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and a != "--"]


def sweep_jobs(overrides: List[str]) -> List[List[str]]:
    """A ``-m`` command line's jobs, as Hydra's basic sweeper makes them (the cartesian product)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(job) for job in itertools.product(*choices)]


def compose_problems(overrides: List[str], config_dir: Optional[str], config_name: str,
                     cpu_world_size: Optional[int]) -> List[str]:
    """Composes as train.py would; with ``cpu_world_size`` also plans the run on the CPU."""
    from conf.schema import compose

    line = " ".join(overrides)
    try:
        cfg = compose(overrides, config_dir=config_dir, config_name=config_name)
    except Exception as e:  # Hydra's errors: unknown key, bad value, missing group option
        return [f"train.py {line}: does not compose: {str(e.__cause__ or e).splitlines()[0]}"]
    if cpu_world_size is None:
        return []
    import torch
    from trainer.plan import plan_run

    try:
        plan_run(cfg, torch.device("cpu"), cpu_world_size)
    except Exception as e:  # ConfigError: a setting that cannot work here
        return [f"train.py {line}: cannot run on a CPU machine: {e}"]
    return []


@lru_cache(maxsize=None)
def headings(path: Path) -> frozenset:
    """GitHub's anchors for a Markdown file's headings (outside code blocks)."""
    text = strip_fences(path.read_text())
    return frozenset(re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M))


def strip_fences(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```\s*$", "", text, flags=re.M | re.S)


def strip_code(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", strip_fences(text))


def link_problems(path: Path, root: Path = ROOT) -> List[str]:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", strip_code(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{path.relative_to(root)}: link to {target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in headings(linked):
            problems.append(f"{path.relative_to(root)}: link to {target}: no heading #{anchor} in {linked.name}")
    return problems


# --- the tests -----------------------------------------------------------------------------------

BLOCKS = marked_blocks()


@pytest.fixture(scope="module")
def checker(pytestconfig) -> Checker:
    markers = [m.split(":", 1)[0].split("(", 1)[0].strip() for m in pytestconfig.getini("markers")]
    return Checker(markers)


@pytest.mark.fast
def test_the_docs_have_runnable_blocks_and_every_bash_fence_names_a_known_mark():
    assert {b.mark for b in BLOCKS} == set(MARKS), "expected ```bash cpu and ```bash gpu blocks in the docs"
    for path in DOCS:
        for block in fenced_blocks(path):
            words = block.info.split()
            if words[:1] == ["bash"]:
                assert len(words) == 1 or (len(words) == 2 and words[1] in MARKS), (
                    f"{block.where}: ```{block.info}: after `bash` write `cpu`, `gpu` or nothing")


def installs_an_extra(block: Block) -> bool:
    return any(tokens[:3] == ["pip", "install", "-r"] and tokens[3:4] and tokens[3] in EXTRAS.values()
               for tokens in commands(block.text))


@pytest.mark.parametrize("block", [pytest.param(b, marks=[pytest.mark.extras] * installs_an_extra(b)) for b in BLOCKS],
                         ids=lambda b: f"{b.where}-{b.mark}")
def test_every_command_of_a_marked_block_works(block, checker):
    found = commands(block.text)
    assert found, f"{block.where}: a marked block without commands"
    problems = [f"{block.where}: {problem}" for tokens in found for problem in checker.check(tokens, block.mark)]
    assert not problems, "\n".join(problems)


@pytest.mark.fast
def test_every_relative_link_leads_to_a_file_and_heading():
    problems = [p for path in DOCS for p in link_problems(path)]
    assert not problems, "\n".join(problems)


def test_a_broken_command_or_link_is_caught(checker, tmp_path):
    """The checks can fail: each of these is a mistake a doc could make."""
    broken = {
        "python train.py recipe=no_such_recipe": "does not compose",
        "python train.py train.epochs=three": "does not compose",
        "python train.py graph=full": "cannot run on a CPU machine",
        "torchrun --standalone --nproc_per_node=2 train.py train.precision=fp16": "cannot run on a CPU machine",
        "python train.py -m graph=eager,full": "cannot run on a CPU machine",
        "torchrun --no-such-option train.py": "torchrun refuses",
        "python scripts/compare.py --no-such-flag 1 -- experiment=debug": "is not in its --help",
        "python scripts/compare.py --modes eager,no_such_mode": "--help exits",
        "python scripts/compare.py -- recipe.data.batch_sise=8": "does not compose",
        "python scripts/no_such_script.py": "does not exist",
        "pytest -m no_such_marker": "no marker",
        "make train": "cannot check",
    }
    for line, expected in broken.items():
        problems = [p for tokens in commands(line) for p in checker.check(tokens, "cpu")]
        assert any(expected in p for p in problems), f"{line!r} passed the check: {problems}"
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[missing](no_such_file.md) [anchor](#no-such-heading) [ok](#title)\n")
    problems = link_problems(page, root=tmp_path)
    assert len(problems) == 2 and "no such file" in problems[0] and "no heading #no-such-heading" in problems[1], problems
