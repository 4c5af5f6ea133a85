"""The faults this project promises to survive, each sent for real to two gloo ranks under torchrun.

| fault                                   | exit: torchrun (rank)  | one message                              | on disk afterwards                                  |
|-----------------------------------------|------------------------|------------------------------------------|-----------------------------------------------------|
| SIGINT (Ctrl-C) under torchrun          | 1, within 5 s          | interrupted (SIGINT): stopping now       | checkpoints intact; the next launch takes over      |
| SIGINT to `python train.py`             | 130, within 5 s        | interrupted (SIGINT)                     | checkpoints intact                                  |
| SIGTERM (preemption) to the whole group | 1, within 10 s         | stopped on SIGTERM at step N ... run_dir | step_N.pt newest; the resumed run ends bit for bit  |
| (host loader, 2 workers each)           |                        |                                          | like an unbroken one                                |
| SIGKILL of rank 1 (host loader, 2       | 0 (restarted)          | killing this rank (the test's); rank 0:  | bit for bit like an unbroken run; newest 2 kept     |
| workers each), --max-restarts=1         |                        | another rank is gone, one line           |                                                     |
| re-run of a finished run                | 0                      | run ... is complete: 64 of 64 steps      | results.json, metrics.jsonl unchanged               |
| ... asking for more steps               | 0                      | resumed from                             | extended; metrics.jsonl appended, never replaced    |
| two launches into one run_dir           | 1 (2), within 30 s     | run_dir=... is in use by another run:    | nothing written by the second launch                |
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
| bad config: Hydra's (compose time)      | 1 (2)                  | expected one of [...]                    | no run directory                                    |
| bad config: ours (after the ranks meet) | 1 (2)                  | asks for 5000 samples per step           | no run directory                                    |
| recipe.data.source=mnist offline        | 1 (2)                  | mnist is not under recipe.data.root      | no run directory                                    |
| unwritable output_root                  | 1 (2)                  | cannot write to the run directory        | no run directory                                    |
| SIGTERM under train.parallel=fsdp2      | 1                      | stopped on SIGTERM at step N ... run_dir | step_N.dcp, each rank's shards; resumed, it ends    |
|                                         |                        |                                          | bit for bit like the unbroken DDP run; newest 2 kept|
| truncated checkpoint.resume=<file>,     | 2 (in-process)         | checkpoint.resume=<file> cannot be read  | nothing trained, the file kept                      |
| fsdp2 (a process group of one)          |                        |                                          |                                                     |

Every row also asserts: no stack trace of ours (torchrun's own report aside), and no process
of the launch left behind (each launch's processes carry a marker in their environment).
The launches of the rows about signals, workers and process lifetime (``PLAIN``: SIGINT, SIGTERM, SIGKILL,
the run's owner meeting a second launch) start plain interpreters, never warm forks (helpers/warm.py): they
are about how processes end under torchrun, down to which process gets a group's signal and which rank's exit
its monitor sees first. The other rows' launches may be warm forks, which end, and pass a group's signal on,
as plain ones do (tests/test_warm_launches.py).
Under torchrun, "1 (N)" is torchrun's exit status and N every rank's, read from torchrun's
report (on SIGINT and SIGTERM torchrun prints none: the ranks exit 130 and 143). The rows
marked in-process run train.py's session in this process (one rank): variants whose
second rank adds nothing, kept as cheap as they were.
Every row runs alone (`pytest tests/test_fault_table.py -k nan-loss`), launching only what it reads.
Launches are shared where one serves several rows: the unbroken run is the reference of the SIGTERM
and SIGKILL rows, and a copy of its directory is what the re-run, truncation, metrics-row, W&B and
"asking for more" rows start from; the SIGTERM run is the owner that the second launch meets; the
NaN run continues a copy of the SIGINT run's directory, taking over from its dead owner. The timed
rows' launches run first, alone; the others then run two at a time. Every launch has a time limit
(tests/helpers/launches.py): a hung rank fails its row, with the stacks of its processes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import pytest
import torch

from helpers.checkpoints import torch_loads
from helpers.fault_injection import KILL_AT_STEP_ENV, QUOTA_AT_STEP_ENV, STOP_CHECK_S_ENV
from helpers.launches import LAUNCH_TIMEOUT_S, Launch
from trainer.checkpoint import latest_checkpoint, list_checkpoints

OURS = ('train.py", line', "trainer/", "recipes/", "graphing/")
# 2048 samples, 2 ranks of 64: 16 steps an epoch, 64 steps; a checkpoint every 10 steps, each epoch, at the end.
ARGS = ["recipe.data.source=synthetic", "recipe.data.train_size=2048", "recipe.data.test_size=512",
        "recipe.data.eval_batch_size=256", "train.max_steps=null", "train.epochs=4", "train.log_every=8",
        "checkpoint.every_steps=10", "logger=none", "train.progress=false"]
STEPS = 64
# SIGTERM is agreed on about every 0.2 s of training here instead of 2 s (tests/helpers/fault_injection.py), so that
# a 64-step run stops within a few steps of the signal.
QUICK_STOP = {STOP_CHECK_S_ENV: "0.2"}
FSDP2_ARGS = [*ARGS, "train.parallel=fsdp2"]
# DataLoader workers under each rank: they get the group's signals too, and the rank alone may end them.
HOST_WORKERS = [*ARGS, "recipe.data.loader=host", "recipe.data.num_workers=2"]
QUICK = ["recipe.data.source=synthetic", "recipe.data.train_size=2048", "recipe.data.test_size=256",
         "logger=none", "train.max_steps=2"]
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}


# ---- launching, and what a launch leaves --------------------------------------------------

# The launches (by name) that start plain interpreters: those of the rows about signals, workers and lifetime.
PLAIN = ("sigint", "sigint1", "owner", "second", "fsdp2_owner", "kill")


@dataclass
class Observed:
    code: int  # the launched process's exit status (torchrun's, or python's)
    output: str  # stdout and stderr together
    run_dir: Optional[Path] = None
    seconds: Optional[float] = None  # from the fault to the exit
    left: List[str] = field(default_factory=list)  # processes of the launch alive after it ended
    torchrun: bool = True
    notes: Dict = field(default_factory=dict)
    warm: bool = False  # its Python processes were warm forks (helpers/warm.py)

    @property
    def rank_codes(self) -> List[int]:
        return sorted(int(line.split(":")[1].split()[0]) for line in self.output.splitlines()
                      if line.strip().startswith("exitcode  :"))


def start(tmp: Path, args: List[str], name: str, run_dir: Optional[Path] = None,
          output_root: Optional[Path] = None, *, nproc: Optional[int] = 2, max_restarts: int = 0, **kw) -> Launch:
    """train.py (tests/helpers/fault_injection.py with ``faults``) under torchrun with ``nproc`` ranks, or as one process
    (nproc None), in the background; its output (stdout and stderr together) in ``tmp/logs/<name>.out``. Plain
    interpreters, never warm forks, for the launches named in ``PLAIN``."""
    extra = [f"run_dir={run_dir}"] if run_dir else []
    launch = Launch([f"output_root={output_root or tmp / name / 'outputs'}", *args, *extra], tmp / "logs",
                    name=name, nproc=nproc, torchrun_args={"rdzv_id": "faults", "max_restarts": max_restarts},
                    merge_output=True, warm=name not in PLAIN, **kw)
    launch.run_dir, launch.torchrun = run_dir, nproc is not None
    return launch


def finish(launch: Launch, since: Optional[float] = None, timeout: float = LAUNCH_TIMEOUT_S) -> Observed:
    """Waits for the launch (at most ``timeout`` s: past it the row fails, the stacks of the hung processes in its
    message); ``seconds``: from ``since`` (the fault) to the launched process's exit."""
    done = launch.finish(timeout)
    return Observed(done.returncode, done.output, launch.run_dir, None if since is None else done.ended - since,
                    done.left, launch.torchrun, warm=launch.warm)


def run(tmp: Path, args: List[str], name: str, run_dir: Optional[Path] = None, **kw) -> Observed:
    """A launch to its end."""
    launch = start(tmp, args, name, run_dir, **kw)
    return finish(launch, since=launch.started)


def in_process(args: List[str], output_root: Path) -> Observed:
    """One rank in this process (train.py's session, no launch): for variants of a row that need no second rank."""
    import contextlib
    import io

    from conf.schema import compose
    from trainer.session import train

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


def train_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"train/loss"') if path.exists() else 0


def steps_kept(run_dir: Path) -> List[int]:
    return [int(p.stem.split("_")[1]) for p in list_checkpoints(run_dir)]


def no_temp_files(run_dir: Path) -> bool:
    return not [p for p in run_dir.rglob("*") if p.name.startswith(".tmp")]


def copy_run(source: Observed, tmp: Path, name: str) -> Path:
    """A copy of ``source``'s run directory, for a row that damages or extends it: the source stays as it was."""
    run_dir = tmp / name / "run"
    shutil.copytree(source.run_dir, run_dir)
    return run_dir


# ---- the launches, each a job that a row reads ---------------------------------------------

class Jobs:
    """Runs each job once, on first need (``get``), in whichever thread needs it first; a later caller waits
    for that run. ``prepare`` runs the timed jobs the selected rows need, alone, then starts the others
    UNTIMED_AT_ONCE at a time in the background."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self._lock = threading.Lock()
        self._slots: Dict[str, Tuple[threading.Lock, list]] = {}
        self._pool = ThreadPoolExecutor(UNTIMED_AT_ONCE, thread_name_prefix="fault-table")

    def get(self, name: str) -> Union[Observed, str]:
        with self._lock:
            lock, outcome = self._slots.setdefault(name, (threading.Lock(), []))
        with lock:  # held while the job runs: the jobs' needs have no cycles, so nothing waits on itself
            if not outcome:
                try:
                    outcome.append((True, JOBS[name](self)))
                except BaseException as e:  # pytest.fail's too: every row that reads this job fails with it
                    outcome.append((False, e))
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def prepare(self, names: List[str]) -> None:
        wanted = set()
        pending = list(names)
        while pending:
            name = pending.pop()
            if name not in wanted:
                wanted.add(name)
                pending.extend(NEEDS.get(name, ()))
        for name in TIMED:
            if name in wanted:
                self.get(name)
        for name in JOBS:  # in JOBS's order: the longest first
            if name in wanted and name not in TIMED and name not in IN_PROCESS:
                self._pool.submit(self.get, name)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # a running job ends within its launch's time limit


def _sigint(jobs: Jobs) -> Observed:
    run_dir = jobs.tmp / "sigint" / "run"
    launch = start(jobs.tmp, ARGS, "sigint", run_dir)
    launch.wait_until(lambda: train_rows(run_dir) >= 3, "3 rows in metrics.jsonl")  # 8, 10, 16: past step 10's checkpoint
    sent = time.monotonic()
    os.killpg(launch.proc.pid, signal.SIGINT)
    done = finish(launch, since=sent, timeout=30)
    done.notes["owner_record"] = json.loads((run_dir / "owner.lock").read_text())  # no teardown: left behind
    done.notes["kept"] = steps_kept(run_dir)
    return done


def _sigint_one_process(jobs: Jobs) -> Observed:
    run_dir = jobs.tmp / "sigint1" / "run"
    launch = start(jobs.tmp, ARGS, "sigint1", run_dir, nproc=None)
    launch.wait_until(lambda: train_rows(run_dir) >= 2, "2 rows in metrics.jsonl")
    sent = time.monotonic()
    os.killpg(launch.proc.pid, signal.SIGINT)
    return finish(launch, since=sent, timeout=30)


def _owner_and_second_launch(jobs: Jobs) -> Dict[str, Observed]:
    """A run (the owner) is frozen mid-training while the same command starts again into its directory;
    then it continues and gets SIGTERM (the resume is the "resumed" job)."""
    tmp = jobs.tmp
    run_dir = tmp / "sigterm" / "run"
    owner = start(tmp, HOST_WORKERS, "owner", run_dir, tmp / "sigterm" / "outputs", faults=QUICK_STOP)
    owner.wait_until(lambda: train_rows(run_dir) >= 1, "a row in metrics.jsonl")
    owner.signal_all(signal.SIGSTOP)  # nothing of the owner writes while the second launch runs
    try:
        time.sleep(0.2)
        before = snapshot(run_dir)
        second = start(tmp, HOST_WORKERS, "second", run_dir, tmp / "sigterm" / "outputs")
        second_done = finish(second, since=second.started, timeout=60)
        after = snapshot(run_dir)
    finally:
        owner.signal_all(signal.SIGCONT)
    second_done.notes.update(before=before, after=after, owner_pid=json.loads((run_dir / "owner.lock").read_text())["pid"])
    sent = time.monotonic()
    os.killpg(owner.proc.pid, signal.SIGTERM)
    term = finish(owner, since=sent, timeout=60)
    term.notes["kept"] = steps_kept(run_dir)
    term.notes["results_exists"] = (run_dir / "results.json").exists()
    term.notes["metrics_before_resume"] = (run_dir / "metrics.jsonl").read_text()
    return {"second": second_done, "sigterm": term}


def _fsdp2_owner(jobs: Jobs) -> Observed:
    """A train.parallel=fsdp2 run stopped by SIGTERM mid-training (the resume is the "fsdp2_resumed" job)."""
    run_dir = jobs.tmp / "fsdp2_sigterm" / "run"
    owner = start(jobs.tmp, FSDP2_ARGS, "fsdp2_owner", run_dir, faults=QUICK_STOP)
    owner.wait_until(lambda: train_rows(run_dir) >= 2, "2 rows in metrics.jsonl")  # past step 10's checkpoint
    sent = time.monotonic()
    os.killpg(owner.proc.pid, signal.SIGTERM)
    term = finish(owner, since=sent, timeout=60)
    term.notes.update(kept=steps_kept(run_dir), results_exists=(run_dir / "results.json").exists(),
                      newest=list_checkpoints(run_dir)[-1],
                      shards=sorted(p.name for p in list_checkpoints(run_dir)[-1].iterdir()))
    return term


def _fsdp2_resumed(jobs: Jobs) -> Observed:
    return run(jobs.tmp, FSDP2_ARGS, "fsdp2_resumed", run_dir=jobs.get("fsdp2_owner").run_dir)


def _unbroken(jobs: Jobs) -> Observed:
    """The reference: ARGS from start to end, no fault. Its newest checkpoint is kept aside for the in-process rows."""
    unbroken = run(jobs.tmp, ARGS, "unbroken", run_dir=jobs.tmp / "unbroken" / "run")
    assert unbroken.code == 0, unbroken.output[-3000:]
    unbroken.notes["results"] = json.loads((unbroken.run_dir / "results.json").read_text())
    pristine = jobs.tmp / "pristine"
    pristine.mkdir()
    unbroken.notes["checkpoint"] = Path(shutil.copy(list_checkpoints(unbroken.run_dir)[-1], pristine))
    return unbroken


def _rerun(jobs: Jobs) -> Observed:
    """The same command again, into a copy of the finished unbroken run: nothing to do, nothing changed."""
    run_dir = copy_run(jobs.get("unbroken"), jobs.tmp, "rerun")
    before = {name: (run_dir / name).read_bytes() for name in ("results.json", "metrics.jsonl")}
    rerun = run(jobs.tmp, ARGS, "rerun", run_dir=run_dir)
    rerun.notes["unchanged"] = all((run_dir / name).read_bytes() == data for name, data in before.items())
    return rerun


def _short(jobs: Jobs) -> Observed:
    """A copy of the unbroken run with its newest checkpoint truncated (as by a full disk) and metrics.jsonl ending
    in half a row (a crash mid-write); the same command, ending before the damaged step."""
    run_dir = copy_run(jobs.get("unbroken"), jobs.tmp, "short")
    newest = run_dir / "checkpoints" / f"step_{STEPS:08d}.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 999999, "trunc')
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    short = run(jobs.tmp, [*ARGS, "train.max_steps=63"], "short", run_dir=run_dir)
    short.notes.update(kept=steps_kept(run_dir), metrics_before=metrics_before,
                       metrics_after=(run_dir / "metrics.jsonl").read_text(),
                       latest=latest_checkpoint(run_dir)[0].name, damaged=newest,
                       steps=json.loads((run_dir / "results.json").read_text())["steps"])
    return short


def _more(jobs: Jobs) -> Observed:
    """A copy of the unbroken run, asked for more steps, with a FILE where W&B's directory goes and W&B on (these
    machines run as root: not chmod)."""
    run_dir = copy_run(jobs.get("unbroken"), jobs.tmp, "more")
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "wandb").write_text("a file where W&B's directory goes")
    more = run(jobs.tmp, [*[a for a in ARGS if a != "logger=none"], "train.epochs=5"], "more", run_dir=run_dir)
    more.notes.update(kept=steps_kept(run_dir), steps=json.loads((run_dir / "results.json").read_text())["steps"],
                      metrics_before=metrics_before, metrics_after=(run_dir / "metrics.jsonl").read_text())
    return more


def _resumed(jobs: Jobs) -> Observed:
    """The run stopped by SIGTERM, resumed by the same command."""
    return run(jobs.tmp, HOST_WORKERS, "resumed", run_dir=jobs.get("owner")["sigterm"].run_dir,
               output_root=jobs.tmp / "sigterm" / "outputs")


def _killed(jobs: Jobs) -> Observed:
    """Host loader with 2 worker processes; rank 1 dies at step 25 (5 steps after the step-20 checkpoint);
    torchrun stops rank 0 (the run directory's lock holder) and its workers, and the restart takes the
    directory over at once, resumes at the exact batch and ends the job. (A new launch taking over from a
    dead lock holder is the NaN row's; a fork child outliving it, tests/test_run_lock.py.)"""
    return run(jobs.tmp, HOST_WORKERS, "kill",
               run_dir=jobs.tmp / "kill" / "run", faults={KILL_AT_STEP_ENV: "25:1"}, max_restarts=1)


def _quota(jobs: Jobs) -> Observed:
    return run(jobs.tmp, ARGS, "quota", run_dir=jobs.tmp / "quota" / "run", faults={QUOTA_AT_STEP_ENV: "12"})


def _full_disk(jobs: Jobs) -> Union[Observed, str]:
    """A real filesystem of 640 KiB, where this machine lets us mount one: room for two checkpoints of this
    model (206 KiB each) and the small files. A string (why not) where it cannot be mounted."""
    disk = jobs.tmp / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(disk)], capture_output=True,
                             timeout=30)
    if mounted.returncode != 0:
        return mounted.stderr.decode().strip() or "mount failed"
    try:
        o = run(jobs.tmp, ARGS, "full_disk", run_dir=disk / "run")
        o.notes.update(kept=steps_kept(o.run_dir), clean=no_temp_files(o.run_dir), rows=rows_of(o.run_dir),
                       results=(o.run_dir / "results.json").exists(),
                       loads=all(torch_loads(p) for p in list_checkpoints(o.run_dir)))
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], capture_output=True, timeout=30)
    return o


def _nan(jobs: Jobs) -> Observed:
    """A copy of the run stopped by SIGINT (its dead owner's record still there: taken over at once) continues with
    an absurd learning rate (a warm-up schedule rewrites the restored lr every step): the loss overflows."""
    run_dir = copy_run(jobs.get("sigint"), jobs.tmp, "nan")
    good = steps_kept(run_dir)
    o = run(jobs.tmp, [*ARGS, "recipe.optim.lr=1e30", "recipe.schedule.warmup_steps=1", "train.log_every=5",
                       "checkpoint.every_steps=5"], "nan", run_dir=run_dir)
    o.notes.update(kept=steps_kept(run_dir), good=good, lock_left=(run_dir / "owner.lock").exists())
    return o


def _bad(name, args, output_root=None, env=None) -> Callable[[Jobs], Observed]:
    def job(jobs: Jobs) -> Observed:
        root = output_root(jobs.tmp) if output_root else jobs.tmp / f"bad_{name}" / "outputs"
        o = run(jobs.tmp, args(jobs.tmp) if callable(args) else args, f"bad_{name}", output_root=root, env=env)
        o.notes["root"] = root
        return o

    return job


def _unwritable_root(tmp: Path) -> Path:
    blocker = tmp / "blocker"
    blocker.write_text("not a directory")
    return blocker / "outputs"


def _named_in_process(name: str, damage: Callable[[Path], None]) -> Callable[[Jobs], Observed]:
    def job(jobs: Jobs) -> Observed:
        path = jobs.tmp / f"named_{name}" / "step.pt"
        path.parent.mkdir()
        shutil.copy(jobs.get("unbroken").notes["checkpoint"], path)
        damage(path)
        done = in_process([*ARGS, f"checkpoint.resume={path}"], jobs.tmp / f"named_{name}" / "outputs")
        done.notes["path"] = path
        return done

    return job


def _named_truncated_fsdp2(jobs: Jobs) -> Observed:
    """A truncated checkpoint named to a train.parallel=fsdp2 run of one process (a process group of one, here)."""
    path = jobs.tmp / "named_fsdp2" / "step.pt"
    path.parent.mkdir()
    shutil.copy(jobs.get("unbroken").notes["checkpoint"], path)
    path.write_bytes(path.read_bytes()[:100])
    done = in_process([*FSDP2_ARGS, f"checkpoint.resume={path}"], jobs.tmp / "named_fsdp2" / "outputs")
    done.notes["path"] = path
    return done


def _foreign(path):
    import argparse

    state = torch.load(path, weights_only=True)
    state["args"] = argparse.Namespace(lr=0.1)  # loadable only with weights_only=False: torch's advice says so
    torch.save(state, path)


def _another_recipe(path):
    state = torch.load(path, weights_only=True)
    state["recipe"] = "gpt_tiny"
    torch.save(state, path)


# The launches no row times run side by side, at most UNTIMED_AT_ONCE at a time (a launch is mostly
# three processes importing torch, and this is a 2-core machine), after the timed ones (SIGINT,
# SIGTERM, the second launch), which run alone.
UNTIMED_AT_ONCE = 2
TIMED = ("sigint", "sigint1", "owner")  # fsdp2's SIGTERM row checks what it leaves, not how fast: the DDP row times
IN_PROCESS = ("named_foreign", "named_truncated", "named_garbage", "another_recipe", "named_truncated_fsdp2")
JOBS: Dict[str, Callable[[Jobs], object]] = {  # the untimed ones longest first
    "sigint": _sigint,
    "sigint1": _sigint_one_process,
    "owner": _owner_and_second_launch,
    "fsdp2_owner": _fsdp2_owner,
    "unbroken": _unbroken,
    "kill": _killed,
    "more": _more,
    "short": _short,
    "rerun": _rerun,
    "resumed": _resumed,
    "fsdp2_resumed": _fsdp2_resumed,
    "quota": _quota,
    "full_disk": _full_disk,
    "nan": _nan,
    "mnist": _bad("mnist", lambda tmp: ["recipe.data.source=mnist", f"recipe.data.root={tmp / 'empty'}", "logger=none"],
                  env=OFFLINE),
    "batch": _bad("batch", [*QUICK, "recipe.data.batch_size=5000"]),
    "unwritable": _bad("unwritable", QUICK, output_root=_unwritable_root),
    "hydra": _bad("hydra", [*QUICK, "graph.capture_error_mode=sometimes"]),
    "named_foreign": _named_in_process("foreign", _foreign),
    "named_truncated": _named_in_process("truncated", lambda p: p.write_bytes(p.read_bytes()[:100])),
    "named_garbage": _named_in_process("garbage", lambda p: p.write_bytes(b"not a checkpoint at all")),
    "another_recipe": _named_in_process("recipe", _another_recipe),
    "named_truncated_fsdp2": _named_truncated_fsdp2,
}
NEEDS = {"rerun": ("unbroken",), "short": ("unbroken",), "more": ("unbroken",), "resumed": ("owner",),
         "fsdp2_resumed": ("fsdp2_owner",),
         "nan": ("sigint",), **{name: ("unbroken",) for name in IN_PROCESS}}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, request):
    """The jobs of this module's selected rows: the timed ones run here, alone; the others start two at a time."""
    jobs = Jobs(tmp_path_factory.mktemp("faults"))
    try:
        rows = [item.callspec.params["row"] for item in request.session.items
                if item.module is request.module and "row" in getattr(getattr(item, "callspec", None), "params", {})]
        jobs.prepare([name.partition(":")[0] for row in rows for name in (row.job, *row.reads)])
        yield jobs
    finally:
        jobs.close()


# ---- what each row expects on disk ----------------------------------------------------------

def _sigint_disk(o: Observed, jobs: Jobs) -> None:
    assert o.notes["owner_record"]["host"] and o.notes["kept"] and 10 in o.notes["kept"]
    assert all(torch_loads(p) for p in list_checkpoints(o.run_dir)) and no_temp_files(o.run_dir)
    assert not (o.run_dir / "results.json").exists()
    # The next launch into (a copy of) this directory, the NaN row's, takes over from the dead owner at once.


def _sigint_one_disk(o: Observed, jobs: Jobs) -> None:
    assert all(torch_loads(p) for p in list_checkpoints(o.run_dir)) and no_temp_files(o.run_dir)
    assert not (o.run_dir / "results.json").exists()


def _sigterm_disk(o: Observed, jobs: Jobs) -> None:
    unbroken = jobs.get("unbroken")
    stopped_at = int(o.output.split("stopped on SIGTERM at step ")[1].split(",")[0])
    assert f"run_dir={o.run_dir}" in o.output
    assert o.notes["kept"][-1] == stopped_at and 0 < stopped_at < STEPS and not o.notes["results_exists"]
    resumed = jobs.get("resumed")
    assert resumed.code == 0, resumed.output[-3000:]
    assert f"resumed from {o.run_dir / 'checkpoints' / f'step_{stopped_at:08d}.pt'}" in resumed.output
    b = json.loads((o.run_dir / "results.json").read_text())
    a = unbroken.notes["results"]
    assert a["steps"] == b["steps"] == STEPS
    assert a["param_digests"] == b["param_digests"], "preempted and resumed must equal unbroken, bit for bit"
    assert (o.run_dir / "metrics.jsonl").read_text().startswith(o.notes["metrics_before_resume"])  # appended


def _fsdp2_sigterm_disk(o: Observed, jobs: Jobs) -> None:
    stopped_at = int(o.output.split("stopped on SIGTERM at step ")[1].split(",")[0])
    assert o.notes["kept"][-1] == stopped_at and 0 < stopped_at < STEPS and not o.notes["results_exists"]
    resumed, ddp = jobs.get("fsdp2_resumed"), jobs.get("unbroken")
    assert resumed.code == 0, resumed.output[-3000:]
    stopped = o.run_dir / "checkpoints" / f"step_{stopped_at:08d}.dcp"  # a directory: each rank wrote its shards
    assert o.notes["newest"] == stopped and f"resumed from {stopped}" in resumed.output
    assert o.notes["shards"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.pt"]
    # Sharded, the same run as DDP's (the same seed, data and fp32 arithmetic; two ranks' gradients summed
    # and halved, exactly, either way): preempted and resumed under fsdp2, it ends bit for bit like the
    # unbroken DDP run.
    a, b = ddp.notes["results"], json.loads((o.run_dir / "results.json").read_text())
    assert a["steps"] == b["steps"] == STEPS and len(set(b["param_digests"])) == 1  # gathered whole on every rank
    assert a["param_digests"] == b["param_digests"], "fsdp2, preempted and resumed, must equal DDP's unbroken run"
    assert a["final/eval_loss"] == b["final/eval_loss"]
    assert steps_kept(o.run_dir) == [60, 64]  # checkpoint.keep=2, as under DDP


def _killed_disk(o: Observed, jobs: Jobs) -> None:
    unbroken = jobs.get("unbroken")
    assert "killing this rank at step 25" in o.output and "step_00000020.pt at step 20" in o.output
    assert o.output.count("another rank is gone") == 1  # rank 0, the survivor: one line, no stack trace
    a, b = unbroken.notes["results"], json.loads((o.run_dir / "results.json").read_text())
    assert b["steps"] == a["steps"] == STEPS and len(set(a["param_digests"])) == 1
    assert a["param_digests"] == b["param_digests"], "resumed run must equal the uninterrupted one bit for bit"
    assert a["final/eval_loss"] == b["final/eval_loss"]
    assert steps_kept(o.run_dir) == [60, 64]  # checkpoint.keep=2


def _rerun_disk(o: Observed, jobs: Jobs) -> None:
    assert o.notes["unchanged"]


def _second_launch_disk(o: Observed, jobs: Jobs) -> None:
    assert o.notes["before"] == o.notes["after"], "the second launch wrote into the owner's directory"
    assert f"pid {o.notes['owner_pid']} on host" in o.output and "since" in o.output


def _quota_disk(o: Observed, jobs: Jobs) -> None:
    # Failing from step 12: the epoch's end (16) is the first checkpoint that cannot be written.
    assert "step_00000016.pt: RuntimeError: [enforce fail" in o.output and "the last good checkpoint is" in o.output
    assert str(o.run_dir / "checkpoints" / "step_00000010.pt") in o.output and "free there" in o.output
    assert steps_kept(o.run_dir) == [10] and torch_loads(list_checkpoints(o.run_dir)[0])
    assert no_temp_files(o.run_dir) and not (o.run_dir / "results.json").exists()
    assert [r["step"] for r in rows_of(o.run_dir) if "train/loss" in r] == [8, 10, 16]  # every row on disk
    assert not (o.run_dir / "owner.lock").exists()  # the ranks stopped together, the lock given back


def _full_disk_disk(o: Observed, jobs: Jobs) -> None:
    # Checkpoints at 10 and 16 (the epoch's end) fill it; the one at 20 is refused before a byte is written.
    assert o.notes["kept"] == [10, 16] and o.notes["loads"] and o.notes["clean"] and not o.notes["results"]
    assert "step_00000020.pt: not enough free space; it needs about" in o.output and "free there" in o.output
    assert [r["step"] for r in o.notes["rows"] if "train/loss" in r][-1] == 20


def _truncated_disk(o: Observed, jobs: Jobs) -> None:
    damaged = o.notes["damaged"].name  # step 64, named in the warning; resumed from the one before
    assert damaged in o.output and "step_00000060.pt at step 60" in o.output
    assert o.notes["steps"] == 63  # ended before the damaged file's step ...
    assert o.notes["kept"] == [60, 63]  # ... and keep=2 counted readable files only: the damaged one is gone
    assert "removing unreadable checkpoint" in o.output
    assert o.notes["latest"] == "step_00000063.pt"  # so the next resume continues from this run's own newest
    assert all(torch_loads(p) for p in list_checkpoints(o.run_dir))


def _more_disk(o: Observed, jobs: Jobs) -> None:
    assert "resumed from" in o.output and "skipping unreadable" not in o.output
    assert o.notes["steps"] == 80 and o.notes["kept"] == [70, 80]
    assert o.notes["metrics_after"].startswith(o.notes["metrics_before"])  # appended, never replaced
    assert len(o.notes["metrics_after"]) > len(o.notes["metrics_before"])


def _metrics_row_disk(o: Observed, jobs: Jobs) -> None:
    before, after = o.notes["metrics_before"], o.notes["metrics_after"]
    assert after.startswith(before + "\n")  # the damaged row stays, alone on its line
    new_rows = [json.loads(line) for line in after[len(before) + 1:].splitlines()]
    assert new_rows and all("step" in r or "summary" in r for r in new_rows)


def _named_disk(o: Observed, jobs: Jobs) -> None:
    path = o.notes["path"]
    assert o.output.count(str(path)) == (2 if o.torchrun else 1), o.output[-3000:]  # (+ torchrun's report)
    assert "checkpoint.resume=auto" in o.output and "weights_only" not in o.output
    assert path.exists()  # a file the user named is reported, never removed
    assert not list(Path(str(path.parent)).rglob("results.json"))  # nothing trained


def _wandb_disk(o: Observed, jobs: Jobs) -> None:
    assert (o.run_dir / "wandb").read_text() == "a file where W&B's directory goes"
    new_rows = [json.loads(line) for line in o.notes["metrics_after"][len(o.notes["metrics_before"]):].splitlines()]
    assert [r["step"] for r in new_rows if "train/loss" in r] == [70, 72, 80]  # training went on from 64, logged
    assert new_rows[-1]["summary"]["steps"] == 80 and o.notes["steps"] == 80


def _nan_disk(o: Observed, jobs: Jobs) -> None:
    good = o.run_dir / "checkpoints" / f"step_{o.notes['good'][-1]:08d}.pt"
    assert f"resumed from {good}" in o.output
    failed_at = int(o.output.split("non-finite (NaN/Inf) by step ")[1].split(":")[0])
    kept = o.notes["kept"]
    assert o.notes["good"][-1] in kept and max(kept) < failed_at, (kept, failed_at)
    assert not o.notes["lock_left"]  # the ranks stopped together and gave the directory back


def _no_run_dir(o: Observed, jobs: Jobs) -> None:
    assert not o.notes["root"].exists(), "a config error leaves no run directory behind"


def _mnist_disk(o: Observed, jobs: Jobs) -> None:
    assert "recipe.data.source=synthetic" in o.output
    _no_run_dir(o, jobs)


def _unwritable_disk(o: Observed, jobs: Jobs) -> None:
    assert "output_root=" in o.output


# ---- the table ------------------------------------------------------------------------------

@dataclass
class Row:
    job: str  # the launch this row reads: a job's name, "owner:second" for a part of one
    exit: int  # the launched process's exit status (torchrun's under torchrun)
    rank_exit: Optional[int]  # every rank's code in torchrun's report; None: no report (exit 0, one process)
    message: str  # said exactly once (and, for our errors under torchrun, once more in torchrun's report)
    disk: Callable[[Observed, Jobs], None]
    within_s: Optional[float] = None  # from the fault to the last process gone
    reads: Tuple[str, ...] = ()  # the other jobs its disk check reads


TABLE = [
    pytest.param(Row("sigint", 1, None, "interrupted (SIGINT): stopping now", _sigint_disk, 5), id="sigint-torchrun"),
    pytest.param(Row("sigint1", 130, None, "interrupted (SIGINT)", _sigint_one_disk, 5),
                 id="sigint-one-process"),
    pytest.param(Row("owner:sigterm", 1, None, "stopped on SIGTERM at step", _sigterm_disk, 10, ("resumed", "unbroken")), id="sigterm"),
    pytest.param(Row("kill", 0, None, "killing this rank at step 25", _killed_disk, reads=("unbroken",)),
                 id="sigkill-rank1-restart-host-loader"),
    pytest.param(Row("rerun", 0, None, f"is complete: {STEPS} of {STEPS} steps done", _rerun_disk),
                 id="rerun-finished"),
    pytest.param(Row("more", 0, None, "resumed from", _more_disk), id="rerun-asking-for-more"),
    # The owner is frozen (SIGSTOP) while the second launch runs: one that waited for it would not end at all.
    # "At once" is torchrun's start, two ranks' imports and the plan: 7 s on a quiet 2-core machine, up to 12.9 s
    # seen with other launches beside it; 30 s keeps room for that and still tells a refusal from a wait.
    pytest.param(Row("owner:second", 1, 2, "is in use by another run", _second_launch_disk, 30),
                 id="two-launches-one-run-dir"),
    pytest.param(Row("full_disk", 1, 5, "not enough free space", _full_disk_disk), id="full-disk-tmpfs"),
    pytest.param(Row("quota", 1, 5, "cannot write checkpoint", _quota_disk), id="failed-write-injected"),
    pytest.param(Row("short", 0, None, "skipping unreadable checkpoint", _truncated_disk),
                 id="truncated-newest-checkpoint"),
    pytest.param(Row("named_foreign", 2, None, "cannot be read (truncated or not a checkpoint: UnpicklingError",
                     _named_disk), id="named-foreign-checkpoint-in-process"),
    pytest.param(Row("named_truncated", 2, None, "cannot be read (truncated or not a checkpoint", _named_disk),
                 id="named-truncated-checkpoint-in-process"),
    pytest.param(Row("named_garbage", 2, None, "cannot be read (truncated or not a checkpoint", _named_disk),
                 id="named-garbage-checkpoint-in-process"),
    pytest.param(Row("another_recipe", 2, None, "of recipe 'gpt_tiny' but recipe=mnist", lambda o, r: None),
                 id="another-recipes-checkpoint-in-process"),
    pytest.param(Row("short", 0, None, "ends in an incomplete row", _metrics_row_disk),
                 id="half-a-row-in-metrics-jsonl"),
    pytest.param(Row("more", 0, None, "W&B could not start", _wandb_disk), id="wandb-dir-unwritable"),
    pytest.param(Row("nan", 1, 4, "the training loss became non-finite", _nan_disk), id="nan-loss"),
    pytest.param(Row("hydra", 1, 2, "expected one of [global, thread_local, relaxed]", _no_run_dir),
                 id="bad-config-hydra"),
    pytest.param(Row("batch", 1, 2, "asks for 5000 samples per step on each rank", _no_run_dir),
                 id="bad-config-ours"),
    pytest.param(Row("mnist", 1, 2, "recipe.data.source=mnist but mnist is not under recipe.data.root",
                     _mnist_disk), id="mnist-offline-no-files"),
    pytest.param(Row("unwritable", 1, 2, "cannot write to the run directory", _unwritable_disk, None),
                 id="unwritable-output-root"),
    pytest.param(Row("fsdp2_owner", 1, None, "stopped on SIGTERM at step", _fsdp2_sigterm_disk,
                     reads=("fsdp2_resumed", "unbroken")), id="sigterm-fsdp2"),
    pytest.param(Row("named_truncated_fsdp2", 2, None, "cannot be read (truncated or not a checkpoint", _named_disk),
                 id="named-truncated-checkpoint-fsdp2-in-process"),
]


@pytest.mark.parametrize("row", TABLE)
def test_fault(row: Row, jobs: Jobs):
    name, _, part = row.job.partition(":")
    o = jobs.get(name)
    if isinstance(o, str):
        pytest.skip(f"cannot mount a small tmpfs here ({o}): the injected row covers it")
    o = o[part] if part else o
    assert not (o.warm and name in PLAIN), "a row about signals, workers or lifetime ran warm forks"
    text = o.output
    assert o.code == row.exit, f"exit {o.code}, expected {row.exit}:\n{text[-3000:]}"
    if row.rank_exit is not None:
        assert o.rank_codes and set(o.rank_codes) == {row.rank_exit}, (o.rank_codes, text[-3000:])
    # Once; ours under torchrun also stand in torchrun's report, once, in place of its generic line (Hydra's
    # own words, printed before any of our code runs, do not).
    in_report = sum(1 for line in text.splitlines() if "traceback : " in line and row.message in line)
    ours = row.rank_exit in (2, 4, 5) and row.job != "hydra"
    assert in_report == (1 if o.torchrun and ours else 0), text[-3000:]
    assert text.count(row.message) == 1 + in_report, \
        f"expected {row.message!r} once (and once in torchrun's report for ours):\n{text[-3000:]}"
    assert not any(mark in text for mark in OURS), f"a stack trace of ours:\n{text[-3000:]}"
    assert "Traceback" not in text or o.torchrun, text[-3000:]  # torchrun's own report has one
    assert not o.left, f"processes left behind: {o.left}"
    if row.within_s is not None and o.seconds is not None:
        assert o.seconds < row.within_s, f"{o.seconds:.1f} s:\n{text[-3000:]}"
    row.disk(o, jobs)
