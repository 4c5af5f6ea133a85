"""A lost or stuck rank never hangs the job (trainer/run/watchdog.py, trainer/run/stall_guard.py).

Two "nodes" of one gloo rank each: two torchrun agents on this machine meeting through a c10d rendezvous, as
tests/test_multinode.py starts them, plain interpreters (the test is about how processes end). One rank is stopped
with SIGSTOP in the middle of training: the other ends within the deadline, saying which rank and step waited how
long, with exit code 8 in torchrun's report; the stopped rank is ended by its guard; no process of the job is left.
"""
from __future__ import annotations

import re
import signal
import time
import uuid

import psutil
import pytest

from helpers.launches import Launch, free_port

STALL_S = 5  # train.stall_timeout_s here; the default is 60
ARGS = ["recipe=mnist", "recipe.data.source=synthetic", "recipe.data.train_size=4096", "recipe.data.test_size=256",
        "recipe.data.batch_size=32", "train.epochs=1000", "train.log_every=5", "train.progress=false",
        "logger=none", "checkpoint.save=false", f"train.stall_timeout_s={STALL_S}",
        "train.eval=false"]  # no evaluation: its allowance (15 min) would outlast the guard's 10 s if a stop fell in one


def agent(node: int, port: int, run_id: str, output_root, log_dir) -> Launch:
    return Launch([*ARGS, f"output_root={output_root}"], log_dir, name=f"node{node}", nproc=1, warm=False,
                  torchrun_args={"rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": run_id,
                                 "extra": ["--nnodes=2", f"--rdzv-conf=is_host={1 if node == 0 else 0}"]},
                  merge_output=True)


def rank_pid(launch: Launch) -> int:
    """The rank's process of one agent: train.py's interpreter, not torchrun's nor the stall guard."""
    for pid in launch.pids():
        try:
            cmdline = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if "train.py" in cmdline and "torch.distributed.run" not in cmdline:
            return pid
    raise AssertionError(f"no rank process among {launch.pids()}")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def two_nodes(tmp_path, name: str):
    """Two agents of one rank each, meeting in one job: started, not waited for."""
    port, run_id = free_port(), f"{name}-{uuid.uuid4().hex[:8]}"
    return [agent(node, port, run_id, tmp_path / "outputs", tmp_path / "agents") for node in (0, 1)]


def wait_until_training(tmp_path) -> None:
    """Until the job has logged its first steps, and a second more: past every first step's allowance."""
    wait_for(lambda: any(p.stat().st_size for p in (tmp_path / "outputs").rglob("metrics.jsonl")), 180,
             "the first logged steps")
    time.sleep(1.0)


def nodes_output(tmp_path) -> str:
    return "\n".join(f"--- node {n} ---\n{(tmp_path / 'agents' / f'node{n}.out').read_text()[-4000:]}"
                     for n in (0, 1))


def launch_with_fault(args, tmp_path, faults, nproc: int, timeout: float):
    """One torchrun of ``nproc`` ranks with a fault of tests/helpers/fault_injection.py, run to its end, plain
    interpreters: (the finished launch, the seconds it took)."""
    from helpers.launches import launch

    began = time.monotonic()
    done = launch(args, tmp_path / "outputs", nproc=nproc, warm=False, timeout=timeout, merge_output=True,
                  faults=faults)
    return done, time.monotonic() - began


def assert_ended_by_the_watchdog(done, what: str, step: str = r"\d+") -> None:
    """Rank 0's watchdog named ``what`` and the step (a regex), and torchrun reported its exit code 8."""
    out = done.output
    assert done.returncode != 0, out[-4000:]
    assert re.search(rf"rank 0: no progress for \d+ s in {what} at step {step}", out), out[-4000:]
    assert "exitcode: 8" in out or "exitcode  : 8" in out, out[-4000:]  # torchrun's report


def test_a_rank_stopped_mid_run_ends_the_job_within_the_deadline_with_exit_8(tmp_path):
    agents = two_nodes(tmp_path, "stall")
    try:
        wait_until_training(tmp_path)
        stopped = rank_pid(agents[1])
        psutil.Process(stopped).send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        first = agents[0].finish(timeout=60)
        survivor_s = time.monotonic() - stopped_at
        second = agents[1].finish(timeout=60)
        ended_s = time.monotonic() - stopped_at
    finally:
        for a in agents:
            a.kill()
    output = nodes_output(tmp_path)
    assert first.returncode != 0 and second.returncode != 0, output
    # the surviving rank: within the deadline (and the watchdog's 1 s look), one message naming rank, step, wait
    assert survivor_s < STALL_S + 15, f"{survivor_s:.1f} s\n{output}"
    said = re.search(r"rank 0: no progress for (\d+) s in a training step at step (\d+) \(train.stall_timeout_s=5\)",
                     first.output)
    assert said and int(said.group(1)) >= STALL_S and int(said.group(2)) > 0, output
    assert "exitcode  : 8" in first.output or "exitcode: 8" in first.output, output  # torchrun's report
    # the stopped rank: ended by its guard, which says why
    assert "rank 1 (pid" in second.output and "has run no Python for" in second.output, output
    assert ended_s < 2 * STALL_S + 30, f"{ended_s:.1f} s\n{output}"
    assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == psutil.STATUS_ZOMBIE
    for a in agents:
        assert not a.pids(), f"left behind: {a.pids()}\n{output}"


@pytest.mark.fast
def test_a_stall_timeout_below_a_second_is_refused_naming_the_setting(train_here):
    done = train_here(["experiment=debug", "logger=none", "train.stall_timeout_s=0.5"])
    assert done.returncode == 2
    assert "train.stall_timeout_s=0.5 must be at least 1 (seconds), or null" in done.stderr


def test_a_rank_stuck_in_c_holding_the_gil_is_ended_and_the_restarted_job_ends_like_an_unbroken_one(tmp_path):
    """One torchrun of two ranks, ``--max-restarts=1``: rank 1 calls C's sleep holding the GIL after step 20 on
    the first attempt. Rank 0's watchdog ends it with 8; rank 1's guard ends rank 1 (no thread of its own runs);
    torchrun restarts the job, which resumes from the checkpoint of step 16 and ends with the weights of a run
    that was never stopped."""
    from helpers.fault_injection import HOLD_GIL_AT_STEP_ENV
    from helpers.launches import launch_together

    args = [*ARGS, "train.epochs=1", "train.max_steps=40", "checkpoint.save=true", "checkpoint.every_steps=8",
            "train.precision=fp32"]
    runs = launch_together({"unbroken": args, "stuck": args}, tmp_path / "runs", nproc=2, timeout=300,
                           each={"stuck": {"faults": {HOLD_GIL_AT_STEP_ENV: "20:1"}, "warm": False,
                                           "torchrun_args": {"max_restarts": 1}}})
    unbroken, stuck = runs["unbroken"], runs["stuck"]
    assert unbroken.returncode == 0, unbroken.output[-3000:]
    assert stuck.returncode == 0, stuck.output[-5000:]
    out = stuck.output
    assert "holding the GIL in C from step 20" in out, out[-5000:]
    assert re.search(r"rank 0: no progress for \d+ s in a training step at step 2\d", out), out[-5000:]
    assert "rank 1 (pid" in out and "has run no Python for" in out, out[-5000:]
    assert "resumed from" in out and "step_00000016" in out, out[-5000:]
    assert stuck.results()["param_digests"] == unbroken.results()["param_digests"]
    assert not stuck.left and not unbroken.left


def test_a_peer_lost_before_an_evaluation_ends_the_job_within_the_deadline_not_the_evaluations_allowance(tmp_path):
    """Rank 1 stops itself after step 8, the end of the first epoch; rank 0 evaluates (its batches mark progress as
    steps do) and waits in the evaluation's all-reduce: it ends with 8 within the stall timeout, not the 15 minutes
    a whole evaluation was once allowed; rank 1's guard ends rank 1; nothing is left."""
    from helpers.fault_injection import STOP_AT_STEP_ENV

    args = [*[a for a in ARGS if a not in ("train.eval=false", "recipe.data.train_size=4096")],
            "recipe.data.train_size=512", "train.eval=true", "train.precision=fp32"]  # 8 steps an epoch on 2 ranks
    done, took = launch_with_fault(args, tmp_path, {STOP_AT_STEP_ENV: "8:1"}, nproc=2, timeout=150)
    assert "stopping this rank after step 8" in done.output, done.output[-4000:]
    assert_ended_by_the_watchdog(done, "an evaluation", "8")
    assert took < 90, f"{took:.0f} s to end with train.stall_timeout_s={STALL_S}"
    assert not done.left, done.left


def test_a_frozen_node_ends_the_job_and_leaves_nothing_once_it_wakes(tmp_path):
    """Node 1's agent and rank both stopped (a frozen machine): rank 0 ends with 8 within the deadline, node 1's
    guard (not stopped: a process of its own) ends its rank; when the node wakes, its agent finds its rank gone
    and ends too. No process of the job is left."""
    agents = two_nodes(tmp_path, "frozen")
    try:
        wait_until_training(tmp_path)
        frozen = [agents[1].proc.pid, rank_pid(agents[1])]
        for pid in frozen:
            psutil.Process(pid).send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        first = agents[0].finish(timeout=60)
        survivor_s = time.monotonic() - stopped_at
        wait_for(lambda: not psutil.pid_exists(frozen[1]) or psutil.Process(frozen[1]).status() ==
                 psutil.STATUS_ZOMBIE, 2 * STALL_S + 30, "the guard to end the frozen rank")
        psutil.Process(frozen[0]).send_signal(signal.SIGCONT)  # the node wakes
        second = agents[1].finish(timeout=120)
    finally:
        for a in agents:
            a.kill()
    output = nodes_output(tmp_path)
    assert first.returncode != 0 and second.returncode != 0, output
    assert survivor_s < STALL_S + 15, f"{survivor_s:.1f} s\n{output}"
    assert re.search(r"rank 0: no progress for \d+ s in a training step", first.output), output
    assert "rank 1 (pid" in second.output and "has run no Python for" in second.output, output
    for a in agents:
        assert not a.pids(), f"left behind: {a.pids()}\n{output}"
