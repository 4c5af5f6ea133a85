"""The faults this project promises to survive, each sent for real to two gloo ranks under torchrun.

| fault                                   | exit: torchrun (rank)  | one message                              | on disk afterwards                                  |
|-----------------------------------------|------------------------|------------------------------------------|-----------------------------------------------------|
| SIGINT (Ctrl-C) under torchrun          | 1, within 5 s          | interrupted (SIGINT): stopping now       | checkpoints intact; the next launch takes over      |
| SIGINT to `python train.py`             | 130, within 5 s        | interrupted (SIGINT)                     | checkpoints intact                                  |
| SIGTERM (preemption)                    | 1, within 10 s         | stopped on SIGTERM at step N ... run_dir | step_N.pt newest; the resumed run ends bit for bit  |
|                                         |                        |                                          | like an unbroken one                                |
| SIGKILL of rank 1 (host loader, 2       | 0 (restarted)          | killing this rank (the test's); rank 0:  | bit for bit like an unbroken run; newest 2 kept     |
| workers each), --max-restarts=1         |                        | another rank is gone, one line           |                                                     |
| re-run of a finished run                | 0                      | run ... is complete: 64 of 64 steps      | results.json, metrics.jsonl unchanged               |
| ... asking for more steps               | 0                      | resumed from                             | extended; metrics.jsonl appended, never replaced    |
| two launches into one run_dir           | 1 (2), within 10 s     | run_dir=... is in use by another run:    | nothing written by the second launch                |
|                                         |                        | pid P on host H, since T                 |                                                     |
| full disk (a real small tmpfs)          | 1 (5)                  | cannot write checkpoint ...: not enough  | the last good checkpoints, no temp file, rows kept  |
|                                         |                        | free space; needs about N, M free        |                                                     |
| quota / failed write (injected)         | 1 (5)                  | cannot write checkpoint ...: RuntimeError| the last good checkpoint, no temp file, no results  |
| truncated newest checkpoint (auto)      | 0                      | skipping unreadable checkpoint ...       | resumed from the one before; the damaged one removed|
| unreadable checkpoint.resume=<file>     | 2 (in-process)         | checkpoint.resume=<file> cannot be read  | nothing trained, the file kept                      |
| (truncated, garbage, foreign pickle)    |                        |                                          |                                                     |
| another recipe's checkpoint             | 2 (in-process)         | of recipe 'gpt_tiny' but recipe=mnist    | nothing trained                                     |
| half a row at the end of metrics.jsonl  | 0                      | ... ends in an incomplete row            | the bad row kept on its own line, new rows whole    |
| a FILE where the W&B directory goes     | 0                      | W&B could not start                      | metrics.jsonl and results.json complete             |
| NaN loss                                | 1 (4)                  | the training loss became non-finite      | the last good checkpoint (before the NaN) kept      |
| bad config: Hydra's (compose time)      | 1 (1)                  | expected one of [...]                    | no run directory                                    |
| bad config: ours (after the ranks meet) | 1 (2)                  | asks for 5000 samples per step           | no run directory                                    |
| recipe.data.source=mnist offline        | 1 (2)                  | mnist is not under recipe.data.root      | no run directory                                    |
| unwritable output_root                  | 1 (2)                  | cannot write to the run directory        | no run directory                                    |

Every row also asserts: no stack trace of ours (torchrun's own report aside), and no process
of the launch left behind (each launch's processes carry a marker in their environment).
Under torchrun, "1 (N)" is torchrun's exit status and N every rank's, read from torchrun's
report (on SIGINT and SIGTERM torchrun prints none: the ranks exit 130 and 143). The rows
marked in-process run train.py's session in this process (one rank): variants whose
second rank adds nothing, kept as cheap as they were.
Launches are shared where one serves several rows: one unbroken run is the reference of
the SIGTERM and SIGKILL rows and then the directory of the re-run, truncation, metrics-row,
W&B and "asking for more" rows; the SIGTERM run is the owner that the second launch meets;
the NaN run continues the SIGINT run, taking over from its dead owner. Launches that no row
times run two at a time, after the timed ones.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
import torch

from conftest import ROOT, free_port, torch_loads
from fault_injection import FAULT_ENVS, KILL_AT_STEP_ENV, QUOTA_AT_STEP_ENV, STOP_CHECK_S_ENV
from trainer.checkpoint import latest_checkpoint, list_checkpoints

MARK = "GRAPHED_DDP_FAULT_TABLE_LAUNCH"
OURS = ('train.py", line', "trainer/", "recipes/", "graphing/")
# 2048 samples, 2 ranks of 64: 16 steps an epoch, 64 steps; a checkpoint every 10 steps, each epoch, at the end.
ARGS = ["recipe.data.source=synthetic", "recipe.data.train_size=2048", "recipe.data.test_size=512",
        "recipe.data.eval_batch_size=256", "train.max_steps=null", "train.epochs=4", "train.log_every=8",
        "checkpoint.every_steps=10", "logger=none", "train.progress=false"]
STEPS = 64
# SIGTERM is agreed on about every 0.2 s of training here instead of 2 s (tests/fault_injection.py), so that
# a 64-step run stops within a few steps of the signal.
QUICK_STOP = {STOP_CHECK_S_ENV: "0.2"}
QUICK = ["recipe.data.source=synthetic", "recipe.data.train_size=2048", "recipe.data.test_size=256",
         "logger=none", "train.max_steps=2"]
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}


# ---- launching, and what a launch leaves --------------------------------------------------

@dataclass
class Observed:
    code: int  # the launched process's exit status (torchrun's, or python's)
    output: str  # stdout and stderr together
    run_dir: Optional[Path] = None
    seconds: Optional[float] = None  # from the fault to the exit
    left: List[str] = field(default_factory=list)  # processes of the launch alive after it ended
    torchrun: bool = True
    notes: Dict = field(default_factory=dict)

    @property
    def rank_codes(self) -> List[int]:
        return sorted(int(line.split(":")[1].split()[0]) for line in self.output.splitlines()
                      if line.strip().startswith("exitcode  :"))


class Launch:
    """train.py (or tests/fault_injection.py) under torchrun with 2 ranks, or as one process, in the background."""

    def __init__(self, args: List[str], log: Path, *, nproc: Optional[int] = 2, env: Optional[Dict] = None,
                 faults: Optional[Dict] = None, max_restarts: int = 0):
        self.marker = uuid.uuid4().hex
        script = "tests/fault_injection.py" if faults else "train.py"
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=faults",
                    f"--max-restarts={max_restarts}"] if nproc else [sys.executable]
        full_env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE" and k not in FAULT_ENVS}
        full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", MARK: self.marker,
                         **(faults or {}), **(env or {})})
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:  # a file, not a pipe: nobody reads while it runs
            # A session of its own, like a terminal's job: a signal to the group reaches torchrun.
            self.proc = subprocess.Popen([*launcher, script, *args], cwd=ROOT, env=full_env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.torchrun = nproc is not None

    def pids(self) -> List[int]:
        """Live processes of this launch (torchrun, ranks, loader workers, W&B), found by the marker."""
        found, needle = [], f"{MARK}={self.marker}".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes() and \
                        Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry))
            except OSError:
                continue
        return found

    def wait_for_rows(self, metrics: Path, rows: int) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count('"train/loss"') >= rows:
                return
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"no {rows} rows in {metrics}:\n{self.log.read_text()[-3000:]}")

    def signal_all(self, sig) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def finish(self, run_dir: Optional[Path] = None, since: Optional[float] = None, timeout: float = 240) -> Observed:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.signal_all(signal.SIGKILL)
        ended = time.monotonic()
        left = self.pids()
        deadline = time.monotonic() + 10  # a loader worker or W&B may take a moment after its parent
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.pids()
        names = [Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200] for pid in left]
        self.signal_all(signal.SIGKILL)
        return Observed(self.proc.returncode, self.log.read_text(), run_dir,
                        None if since is None else ended - since, names, self.torchrun)


def start(args: List[str], tmp: Path, name: str, run_dir: Optional[Path] = None,
          output_root: Optional[Path] = None, **kw) -> Launch:
    extra = [f"run_dir={run_dir}"] if run_dir else []
    launch = Launch([f"output_root={output_root or tmp / 'outputs'}", *args, *extra], tmp / f"{name}.log", **kw)
    launch.run_dir, launch.started = run_dir, time.monotonic()
    return launch


def run(args: List[str], tmp: Path, name: str, run_dir: Optional[Path] = None, **kw) -> Observed:
    """A launch to its end."""
    launch = start(args, tmp, name, run_dir, **kw)
    return launch.finish(run_dir, since=launch.started)


def in_process(args: List[str], output_root: Path) -> Observed:
    """One rank in this process (train.py's session, no launch): for variants of a row that need no second rank."""
    import contextlib
    import io

    from conf.schema import compose
    from trainer.training import train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train(compose([f"output_root={output_root}", *args]))
    return Observed(code, out.getvalue() + err.getvalue(), torchrun=False)


def snapshot(folder: Path) -> Dict[str, tuple]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.is_dir())
            for p in sorted(folder.rglob("*"))}


def rows_of(run_dir: Path) -> List[Dict]:
    """metrics.jsonl's rows; a line that is not JSON fails here unless it is the one damaged on purpose."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if not line.startswith('{"step": 999999, "trunc')]


def steps_kept(run_dir: Path) -> List[int]:
    return [int(p.stem.split("_")[1]) for p in list_checkpoints(run_dir)]


def no_temp_files(run_dir: Path) -> bool:
    return not [p for p in run_dir.rglob("*") if p.name.startswith(".tmp")]


# ---- the launches (shared between rows) ---------------------------------------------------

@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def sigint(tmp) -> Observed:
    run_dir = tmp / "sigint" / "run"
    launch = Launch([f"output_root={tmp / 'sigint'}", *ARGS, f"run_dir={run_dir}"], tmp / "sigint.log")
    launch.wait_for_rows(run_dir / "metrics.jsonl", 3)  # rows 8, 10, 16: past the step-10 checkpoint
    sent = time.monotonic()
    os.killpg(launch.proc.pid, signal.SIGINT)
    done = launch.finish(run_dir, since=sent, timeout=30)
    done.notes["owner_record"] = json.loads((run_dir / "owner.lock").read_text())  # no teardown: left behind
    done.notes["kept"] = steps_kept(run_dir)
    return done


@pytest.fixture(scope="module")
def sigint_one_process(tmp) -> Observed:
    run_dir = tmp / "sigint1" / "run"
    launch = Launch([f"output_root={tmp / 'sigint1'}", *ARGS, f"run_dir={run_dir}"], tmp / "sigint1.log", nproc=None)
    launch.wait_for_rows(run_dir / "metrics.jsonl", 2)
    sent = time.monotonic()
    os.killpg(launch.proc.pid, signal.SIGINT)
    return launch.finish(run_dir, since=sent, timeout=30)


@pytest.fixture(scope="module")
def owner_and_second_launch(tmp) -> Dict[str, Observed]:
    """A run (the owner) is frozen mid-training while the same command starts again into its directory;
    then it continues and gets SIGTERM; then the same command resumes it."""
    run_dir = tmp / "sigterm" / "run"
    args = [f"output_root={tmp / 'sigterm'}", *ARGS, f"run_dir={run_dir}"]
    owner = Launch(args, tmp / "owner.log", faults=QUICK_STOP)
    owner.wait_for_rows(run_dir / "metrics.jsonl", 1)
    owner.signal_all(signal.SIGSTOP)  # nothing of the owner writes while the second launch runs
    try:
        time.sleep(0.2)
        before = snapshot(run_dir)
        started = time.monotonic()
        second_done = Launch(args, tmp / "second.log").finish(run_dir, since=started, timeout=60)
        after = snapshot(run_dir)
    finally:
        owner.signal_all(signal.SIGCONT)
    second_done.notes.update(before=before, after=after, owner_pid=json.loads((run_dir / "owner.lock").read_text())["pid"])
    sent = time.monotonic()
    os.killpg(owner.proc.pid, signal.SIGTERM)
    term = owner.finish(run_dir, since=sent, timeout=60)
    term.notes["kept"] = steps_kept(run_dir)
    term.notes["results_exists"] = (run_dir / "results.json").exists()
    term.notes["metrics_before_resume"] = (run_dir / "metrics.jsonl").read_text()
    return {"second": second_done, "sigterm": term}  # the resume is in `untimed`


@pytest.fixture(scope="module")
def two_launches(owner_and_second_launch) -> Observed:
    return owner_and_second_launch["second"]


@pytest.fixture(scope="module")
def sigterm(owner_and_second_launch) -> Observed:
    return owner_and_second_launch["sigterm"]


# The launches no row times run side by side, at most UNTIMED_AT_ONCE at a time (a launch is mostly
# three processes importing torch, and this is a 2-core machine). The timed rows' launches (SIGINT,
# SIGTERM, the second launch) ran before, alone.
UNTIMED_AT_ONCE = 2


def _reference_chain(tmp) -> Dict[str, Observed]:
    """The unbroken reference (ARGS from start to end); then, in its directory: the same command again
    (finished: nothing to do); its newest checkpoint truncated (as by a full disk) and metrics.jsonl ending
    in half a row (a crash mid-write), the same command ending before the damaged step; then asking for
    more steps, with a FILE where W&B's directory goes and W&B on (these machines run as root: not chmod)."""
    run_dir = tmp / "unbroken" / "run"
    unbroken = run(ARGS, tmp / "unbroken", "unbroken", run_dir=run_dir)
    assert unbroken.code == 0, unbroken.output[-3000:]
    unbroken.notes["results"] = json.loads((run_dir / "results.json").read_text())
    pristine = tmp / "pristine"
    pristine.mkdir()
    unbroken.notes["checkpoint"] = Path(shutil.copy(list_checkpoints(run_dir)[-1], pristine))

    before = {name: (run_dir / name).read_bytes() for name in ("results.json", "metrics.jsonl")}
    rerun = run(ARGS, tmp / "unbroken", "rerun", run_dir=run_dir)
    rerun.notes["unchanged"] = all((run_dir / name).read_bytes() == data for name, data in before.items())

    newest = run_dir / "checkpoints" / f"step_{STEPS:08d}.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 999999, "trunc')
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    short = run([*ARGS, "train.max_steps=63"], tmp / "unbroken", "short", run_dir=run_dir)
    short.notes.update(kept=steps_kept(run_dir), metrics_before=metrics_before,
                       metrics_after=(run_dir / "metrics.jsonl").read_text(),
                       latest=latest_checkpoint(run_dir)[0].name, damaged=newest,
                       steps=json.loads((run_dir / "results.json").read_text())["steps"])

    metrics_before_more = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "wandb").write_text("a file where W&B's directory goes")
    more = run([*[a for a in ARGS if a != "logger=none"], "train.epochs=5"], tmp / "unbroken", "more",
               run_dir=run_dir)
    more.notes.update(kept=steps_kept(run_dir), steps=json.loads((run_dir / "results.json").read_text())["steps"],
                      metrics_before=metrics_before_more, metrics_after=(run_dir / "metrics.jsonl").read_text())
    return {"unbroken": unbroken, "rerun": rerun, "short": short, "more": more}


def _killed(tmp) -> Observed:
    """Host loader with 2 worker processes; rank 1 dies at step 25 (5 steps after the step-20 checkpoint);
    torchrun stops rank 0 (the run directory's lock holder) and its workers, and the restart takes the
    directory over at once, resumes at the exact batch and ends the job. (A new launch taking over from a
    dead lock holder is the NaN row's; a fork child outliving it, tests/test_run_lock.py.)"""
    return run([*ARGS, "recipe.data.loader=host", "recipe.data.num_workers=2"], tmp / "kill", "kill",
               run_dir=tmp / "kill" / "run", faults={KILL_AT_STEP_ENV: "25:1"}, max_restarts=1)


def _full_disk(tmp):
    """A real filesystem of 640 KiB, where this machine lets us mount one: room for two checkpoints of this
    model (206 KiB each) and the small files. A string (why not) where it cannot be mounted."""
    disk = tmp / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        return mounted.stderr.decode().strip() or "mount failed"
    try:
        o = run(ARGS, tmp / "disk_outputs", "full_disk", run_dir=disk / "run")
        o.notes.update(kept=steps_kept(o.run_dir), clean=no_temp_files(o.run_dir), rows=rows_of(o.run_dir),
                       results=(o.run_dir / "results.json").exists(),
                       loads=all(torch_loads(p) for p in list_checkpoints(o.run_dir)))
    finally:
        subprocess.run(["umount", str(disk)])
    return o


def _nan(tmp, sigint) -> Observed:
    """The run stopped by SIGINT continues (its dead owner's record still there: taken over at once) with an
    absurd learning rate (a warm-up schedule rewrites the restored lr every step): the loss overflows."""
    good = steps_kept(sigint.run_dir)
    o = run([*ARGS, "recipe.optim.lr=1e30", "recipe.schedule.warmup_steps=1", "train.log_every=5",
             "checkpoint.every_steps=5"], tmp / "sigint", "nan", run_dir=sigint.run_dir)
    o.notes.update(kept=steps_kept(sigint.run_dir), good=good, lock_left=(sigint.run_dir / "owner.lock").exists())
    return o


def _bad(tmp, name, args, output_root=None, env=None) -> Observed:
    root = output_root or tmp / f"bad_{name}" / "outputs"
    o = run(args, tmp / f"bad_{name}", f"bad_{name}", output_root=root, env=env)
    o.notes["root"] = root
    return o


@pytest.fixture(scope="module")
def untimed(tmp, sigint, owner_and_second_launch) -> Dict[str, Observed]:
    from concurrent.futures import ThreadPoolExecutor

    blocker = tmp / "blocker"
    blocker.write_text("not a directory")
    sigterm_dir = owner_and_second_launch["sigterm"].run_dir
    jobs = {  # the longest first
        "reference": lambda: _reference_chain(tmp),
        "kill": lambda: _killed(tmp),
        "resumed": lambda: run(ARGS, tmp / "sigterm", "resumed", run_dir=sigterm_dir),
        "quota": lambda: run(ARGS, tmp / "quota", "quota", run_dir=tmp / "quota" / "run",
                             faults={QUOTA_AT_STEP_ENV: "12"}),
        "full_disk": lambda: _full_disk(tmp),
        "nan": lambda: _nan(tmp, sigint),
        "mnist": lambda: _bad(tmp, "mnist", ["recipe.data.source=mnist", f"recipe.data.root={tmp / 'empty'}",
                                             "logger=none"], env=OFFLINE),
        "batch": lambda: _bad(tmp, "batch", [*QUICK, "recipe.data.batch_size=5000"]),
        "unwritable": lambda: _bad(tmp, "unwritable", QUICK, output_root=blocker / "outputs"),
        "hydra": lambda: _bad(tmp, "hydra", [*QUICK, "graph.capture_error_mode=sometimes"]),
    }
    with ThreadPoolExecutor(UNTIMED_AT_ONCE) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        done = {name: future.result() for name, future in futures.items()}
    done.update(done.pop("reference"))
    return done


def _untimed(name):
    @pytest.fixture(scope="module")
    def observed(untimed) -> Observed:
        if isinstance(untimed[name], str):
            pytest.skip(f"cannot mount a small tmpfs here ({untimed[name]}): the injected row covers it")
        return untimed[name]

    return observed


unbroken, sigkill_rank1, quota, full_disk, nan_loss = (
    _untimed("unbroken"), _untimed("kill"), _untimed("quota"), _untimed("full_disk"), _untimed("nan"))
rerun_finished, truncated_newest, asking_for_more, wandb_dir_is_a_file = (
    _untimed("rerun"), _untimed("short"), _untimed("more"), _untimed("more"))
hydra_refuses, batch_too_large, mnist_offline, unwritable_output = (
    _untimed("hydra"), _untimed("batch"), _untimed("mnist"), _untimed("unwritable"))


def _named_in_process(tmp, unbroken, name, damage) -> Observed:
    path = tmp / f"named_{name}" / "step.pt"
    path.parent.mkdir()
    shutil.copy(unbroken.notes["checkpoint"], path)
    damage(path)
    done = in_process([*ARGS, f"checkpoint.resume={path}"], tmp / f"named_{name}" / "outputs")
    done.notes["path"] = path
    return done


def _foreign(path):
    import argparse

    state = torch.load(path, weights_only=True)
    state["args"] = argparse.Namespace(lr=0.1)  # loadable only with weights_only=False: torch's advice says so
    torch.save(state, path)


@pytest.fixture(scope="module")
def named_foreign(tmp, unbroken) -> Observed:
    return _named_in_process(tmp, unbroken, "foreign", _foreign)


@pytest.fixture(scope="module")
def named_truncated(tmp, unbroken) -> Observed:
    return _named_in_process(tmp, unbroken, "truncated", lambda p: p.write_bytes(p.read_bytes()[:100]))


@pytest.fixture(scope="module")
def named_garbage(tmp, unbroken) -> Observed:
    return _named_in_process(tmp, unbroken, "garbage", lambda p: p.write_bytes(b"not a checkpoint at all"))


@pytest.fixture(scope="module")
def another_recipe(tmp, unbroken) -> Observed:
    def relabel(path):
        state = torch.load(path, weights_only=True)
        state["recipe"] = "gpt_tiny"
        torch.save(state, path)

    return _named_in_process(tmp, unbroken, "recipe", relabel)


# ---- what each row expects on disk ----------------------------------------------------------

def _sigint_disk(o: Observed, request) -> None:
    assert o.notes["owner_record"]["host"] and o.notes["kept"] and 10 in o.notes["kept"]
    assert all(torch_loads(p) for p in list_checkpoints(o.run_dir)) and no_temp_files(o.run_dir)
    assert not (o.run_dir / "results.json").exists()
    # The next launch into this directory (the NaN row's) takes over from the dead owner at once.


def _sigint_one_disk(o: Observed, request) -> None:
    assert all(torch_loads(p) for p in list_checkpoints(o.run_dir)) and no_temp_files(o.run_dir)
    assert not (o.run_dir / "results.json").exists()


def _sigterm_disk(o: Observed, request) -> None:
    unbroken = request.getfixturevalue("unbroken")
    stopped_at = int(o.output.split("stopped on SIGTERM at step ")[1].split(",")[0])
    assert f"run_dir={o.run_dir}" in o.output
    assert o.notes["kept"][-1] == stopped_at and 0 < stopped_at < STEPS and not o.notes["results_exists"]
    resumed = request.getfixturevalue("untimed")["resumed"]
    assert resumed.code == 0, resumed.output[-3000:]
    assert f"resumed from {o.run_dir / 'checkpoints' / f'step_{stopped_at:08d}.pt'}" in resumed.output
    b = json.loads((o.run_dir / "results.json").read_text())
    a = unbroken.notes["results"]
    assert a["steps"] == b["steps"] == STEPS
    assert a["param_digests"] == b["param_digests"], "preempted and resumed must equal unbroken, bit for bit"
    assert (o.run_dir / "metrics.jsonl").read_text().startswith(o.notes["metrics_before_resume"])  # appended


def _killed_disk(o: Observed, request) -> None:
    unbroken = request.getfixturevalue("unbroken")
    assert "killing this rank at step 25" in o.output and "step_00000020.pt at step 20" in o.output
    assert o.output.count("another rank is gone") == 1  # rank 0, the survivor: one line, no stack trace
    a, b = unbroken.notes["results"], json.loads((o.run_dir / "results.json").read_text())
    assert b["steps"] == a["steps"] == STEPS and len(set(a["param_digests"])) == 1
    assert a["param_digests"] == b["param_digests"], "resumed run must equal the uninterrupted one bit for bit"
    assert a["final/eval_loss"] == b["final/eval_loss"]
    assert steps_kept(o.run_dir) == [60, 64]  # checkpoint.keep=2


def _rerun_disk(o: Observed, request) -> None:
    assert o.notes["unchanged"]


def _second_launch_disk(o: Observed, request) -> None:
    assert o.notes["before"] == o.notes["after"], "the second launch wrote into the owner's directory"
    assert f"pid {o.notes['owner_pid']} on host" in o.output and "since" in o.output


def _quota_disk(o: Observed, request) -> None:
    # Failing from step 12: the epoch's end (16) is the first checkpoint that cannot be written.
    assert "step_00000016.pt: RuntimeError: [enforce fail" in o.output and "the last good checkpoint is" in o.output
    assert str(o.run_dir / "checkpoints" / "step_00000010.pt") in o.output and "free there" in o.output
    assert steps_kept(o.run_dir) == [10] and torch_loads(list_checkpoints(o.run_dir)[0])
    assert no_temp_files(o.run_dir) and not (o.run_dir / "results.json").exists()
    assert [r["step"] for r in rows_of(o.run_dir) if "train/loss" in r] == [8, 10, 16]  # every row on disk
    assert not (o.run_dir / "owner.lock").exists()  # the ranks stopped together, the lock given back


def _full_disk_disk(o: Observed, request) -> None:
    # Checkpoints at 10 and 16 (the epoch's end) fill it; the one at 20 is refused before a byte is written.
    assert o.notes["kept"] == [10, 16] and o.notes["loads"] and o.notes["clean"] and not o.notes["results"]
    assert "step_00000020.pt: not enough free space; it needs about" in o.output and "free there" in o.output
    assert [r["step"] for r in o.notes["rows"] if "train/loss" in r][-1] == 20


def _truncated_disk(o: Observed, request) -> None:
    damaged = o.notes["damaged"].name  # step 64, named in the warning; resumed from the one before
    assert damaged in o.output and "step_00000060.pt at step 60" in o.output
    assert o.notes["steps"] == 63  # ended before the damaged file's step ...
    assert o.notes["kept"] == [60, 63]  # ... and keep=2 counted readable files only: the damaged one is gone
    assert "removing unreadable checkpoint" in o.output
    assert o.notes["latest"] == "step_00000063.pt"  # so the next resume continues from this run's own newest
    assert all(torch_loads(p) for p in list_checkpoints(o.run_dir))


def _more_disk(o: Observed, request) -> None:
    assert "resumed from" in o.output and "skipping unreadable" not in o.output
    assert o.notes["steps"] == 80 and o.notes["kept"] == [70, 80]
    assert o.notes["metrics_after"].startswith(o.notes["metrics_before"])  # appended, never replaced
    assert len(o.notes["metrics_after"]) > len(o.notes["metrics_before"])


def _metrics_row_disk(o: Observed, request) -> None:
    before, after = o.notes["metrics_before"], o.notes["metrics_after"]
    assert after.startswith(before + "\n")  # the damaged row stays, alone on its line
    new_rows = [json.loads(line) for line in after[len(before) + 1:].splitlines()]
    assert new_rows and all("step" in r or "summary" in r for r in new_rows)


def _named_disk(o: Observed, request) -> None:
    path = o.notes["path"]
    assert o.output.count(str(path)) == (2 if o.torchrun else 1), o.output[-3000:]  # (+ torchrun's report)
    assert "checkpoint.resume=auto" in o.output and "weights_only" not in o.output
    assert path.exists()  # a file the user named is reported, never removed
    assert not list(Path(str(path.parent)).rglob("results.json"))  # nothing trained


def _wandb_disk(o: Observed, request) -> None:
    assert (o.run_dir / "wandb").read_text() == "a file where W&B's directory goes"
    new_rows = [json.loads(line) for line in o.notes["metrics_after"][len(o.notes["metrics_before"]):].splitlines()]
    assert [r["step"] for r in new_rows if "train/loss" in r] == [64, 70, 72, 80]  # training went on, logged
    assert new_rows[-1]["summary"]["steps"] == 80 and o.notes["steps"] == 80


def _nan_disk(o: Observed, request) -> None:
    good = o.run_dir / "checkpoints" / f"step_{o.notes['good'][-1]:08d}.pt"
    assert f"resumed from {good}" in o.output
    failed_at = int(o.output.split("non-finite (NaN/Inf) by step ")[1].split(":")[0])
    kept = o.notes["kept"]
    assert o.notes["good"][-1] in kept and max(kept) < failed_at, (kept, failed_at)
    assert not o.notes["lock_left"]  # the ranks stopped together and gave the directory back


def _no_run_dir(o: Observed, request) -> None:
    assert not o.notes["root"].exists(), "a config error leaves no run directory behind"


def _mnist_disk(o: Observed, request) -> None:
    assert "recipe.data.source=synthetic" in o.output
    _no_run_dir(o, request)


def _unwritable_disk(o: Observed, request) -> None:
    assert "output_root=" in o.output


# ---- the table ------------------------------------------------------------------------------

@dataclass
class Row:
    scenario: str  # the fixture whose launch this row reads
    exit: int  # the launched process's exit status (torchrun's under torchrun)
    rank_exit: Optional[int]  # every rank's code in torchrun's report; None: no report (exit 0, one process)
    message: str  # said exactly once (and, for our errors under torchrun, once more in torchrun's report)
    disk: Callable[[Observed, object], None]
    within_s: Optional[float] = None  # from the fault to the last process gone


TABLE = [
    pytest.param(Row("sigint", 1, None, "interrupted (SIGINT): stopping now", _sigint_disk, 5), id="sigint-torchrun"),
    pytest.param(Row("sigint_one_process", 130, None, "interrupted (SIGINT)", _sigint_one_disk, 5),
                 id="sigint-one-process"),
    pytest.param(Row("sigterm", 1, None, "stopped on SIGTERM at step", _sigterm_disk, 10), id="sigterm"),
    pytest.param(Row("sigkill_rank1", 0, None, "killing this rank at step 25", _killed_disk),
                 id="sigkill-rank1-restart-host-loader"),
    pytest.param(Row("rerun_finished", 0, None, f"is complete: {STEPS} of {STEPS} steps done", _rerun_disk),
                 id="rerun-finished"),
    pytest.param(Row("asking_for_more", 0, None, "resumed from", _more_disk), id="rerun-asking-for-more"),
    pytest.param(Row("two_launches", 1, 2, "is in use by another run", _second_launch_disk, 10),
                 id="two-launches-one-run-dir"),
    pytest.param(Row("full_disk", 1, 5, "not enough free space", _full_disk_disk), id="full-disk-tmpfs"),
    pytest.param(Row("quota", 1, 5, "cannot write checkpoint", _quota_disk), id="failed-write-injected"),
    pytest.param(Row("truncated_newest", 0, None, "skipping unreadable checkpoint", _truncated_disk),
                 id="truncated-newest-checkpoint"),
    pytest.param(Row("named_foreign", 2, None, "cannot be read (truncated or not a checkpoint: UnpicklingError",
                     _named_disk), id="named-foreign-checkpoint-in-process"),
    pytest.param(Row("named_truncated", 2, None, "cannot be read (truncated or not a checkpoint", _named_disk),
                 id="named-truncated-checkpoint-in-process"),
    pytest.param(Row("named_garbage", 2, None, "cannot be read (truncated or not a checkpoint", _named_disk),
                 id="named-garbage-checkpoint-in-process"),
    pytest.param(Row("another_recipe", 2, None, "of recipe 'gpt_tiny' but recipe=mnist", lambda o, r: None),
                 id="another-recipes-checkpoint-in-process"),
    pytest.param(Row("truncated_newest", 0, None, "ends in an incomplete row", _metrics_row_disk),
                 id="half-a-row-in-metrics-jsonl"),
    pytest.param(Row("wandb_dir_is_a_file", 0, None, "W&B could not start", _wandb_disk), id="wandb-dir-unwritable"),
    pytest.param(Row("nan_loss", 1, 4, "the training loss became non-finite", _nan_disk), id="nan-loss"),
    pytest.param(Row("hydra_refuses", 1, 1, "expected one of [global, thread_local, relaxed]", _no_run_dir),
                 id="bad-config-hydra"),
    pytest.param(Row("batch_too_large", 1, 2, "asks for 5000 samples per step on each rank", _no_run_dir),
                 id="bad-config-ours"),
    pytest.param(Row("mnist_offline", 1, 2, "recipe.data.source=mnist but mnist is not under recipe.data.root",
                     _mnist_disk), id="mnist-offline-no-files"),
    pytest.param(Row("unwritable_output", 1, 2, "cannot write to the run directory", _unwritable_disk, None),
                 id="unwritable-output-root"),
]


@pytest.mark.parametrize("row", TABLE)
def test_fault(row: Row, request):
    o: Observed = request.getfixturevalue(row.scenario)
    text = o.output
    assert o.code == row.exit, f"exit {o.code}, expected {row.exit}:\n{text[-3000:]}"
    if row.rank_exit is not None:
        assert o.rank_codes and set(o.rank_codes) == {row.rank_exit}, (o.rank_codes, text[-3000:])
    # Once; ours under torchrun also stand in torchrun's report, once, in place of its generic line.
    in_report = sum(1 for line in text.splitlines() if "traceback : " in line and row.message in line)
    assert in_report == (1 if o.torchrun and row.rank_exit in (2, 4, 5) else 0), text[-3000:]
    assert text.count(row.message) == 1 + in_report, \
        f"expected {row.message!r} once (and once in torchrun's report for ours):\n{text[-3000:]}"
    assert not any(mark in text for mark in OURS), f"a stack trace of ours:\n{text[-3000:]}"
    assert "Traceback" not in text or o.torchrun, text[-3000:]  # torchrun's own report has one
    assert not o.left, f"processes left behind: {o.left}"
    if row.within_s is not None and o.seconds is not None:
        assert o.seconds < row.within_s, f"{o.seconds:.1f} s:\n{text[-3000:]}"
    row.disk(o, request)
