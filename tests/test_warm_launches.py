"""The tests' warm launches (tests/helpers/warm.py) against plain interpreters, where a fork of a started
interpreter and a fresh one can differ: what a script sees as it starts (its environment in /proc, umask, seeds,
a spawned child's __main__), how it ends, who gets a signal sent to its group (a rank's workers,
under torchrun), which launches must start plain (torch's import-time settings), a server that died (the
launch falls back to plain) or whose starting thread ended (it serves on, and ends with its process), and that
no process of a warm launch escapes the tests' bookkeeping."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import warm
from helpers.launches import launch, start
from helpers.paths import ROOT
from helpers.processes import cmdline, is_live
from scripts.lib.process_tree import kill

pytestmark = pytest.mark.skipif(not warm.enabled(), reason="launches are warm only without CUDA and without "
                                                           "GRAPHED_DDP_TEST_WARM=0")

SEES = '''
import json, multiprocessing, os, random, signal, sys


def main_module_name():  # run by a spawned child, which imports this script again as __mp_main__
    return sys.modules["__mp_main__"].__file__


if __name__ == "__main__":
    preloaded = "torch" in sys.modules  # a warm fork's server imported it
    import psutil

    umask = os.umask(0)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        spawned = pool.apply(main_module_name)
    mark = "GRAPHED_DDP_RUN_MARK"
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                      "given": os.environ.get("GIVEN"), "rank": os.environ.get("RANK"), "hash": hash("a string"),
                      "sigint_ignored": signal.getsignal(2) == signal.SIG_IGN, "umask": umask,
                      "proc_environ": psutil.Process().environ().get(mark) == os.environ[mark],
                      "no_site": sys.flags.no_site, "spawned_main": spawned, "random": random.random(),
                      "preloaded": preloaded}))
    sys.stdout.flush()
    sys.exit(int(os.environ.get("CODE", "0")))
'''


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_script_sees_and_ends_as_under_a_plain_python(tmp_path):
    code = 3
    path = script(tmp_path, "sees.py", SEES)
    umask = os.umask(0o027)  # not the servers': a fork takes its client's
    try:
        runs = {w: start(["one", "two words"], script=path, cwd=tmp_path, env={"GIVEN": "yes", "CODE": str(code)},
                         warm=w, log_dir=tmp_path / str(w)) for w in (True, False)}
    finally:
        os.umask(umask)
    assert runs[True].warm and not runs[False].warm
    done = {w: run.finish(120) for w, run in runs.items()}
    seen = {w: json.loads(run.stdout) for w, run in done.items()}
    for w, run in done.items():
        assert run.returncode == code, run.output
        assert not run.left, run.left
    hot, cold = seen[True], seen[False]
    assert (hot.pop("preloaded"), cold.pop("preloaded")) == (True, False)  # a fork, and a fresh python
    for differs in ("hash", "random"):  # different interpreters (a fork has its server's hash seed)
        assert hot.pop(differs) != cold.pop(differs)
    # SIGINT ignored where this suite runs with it ignored (a CI runner's `cmd &`): kept across the exec, as by a fork
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert hot == cold == {"argv": [path, "one", "two words"], "cwd": str(tmp_path), "path0": str(tmp_path),
                           "name": "__main__", "given": "yes", "rank": None, "sigint_ignored": ignored,
                           "umask": 0o027, "proc_environ": True, "no_site": 0, "spawned_main": path}


def test_two_forks_of_one_server_draw_their_own_random_numbers(tmp_path):
    """Python's, numpy's and torch's generators, seeded from the system's entropy in a fresh interpreter."""
    path = script(tmp_path, "draws.py", "import random, numpy, torch\n"
                                        "print(random.random(), numpy.random.random(), torch.rand(1).item())\n")
    draws = [launch([], script=path, log_dir=tmp_path / str(i)).stdout.split() for i in range(2)]  # both server 0's
    assert all(len(d) == 3 for d in draws) and all(a != b for a, b in zip(*draws)), draws


def test_a_script_killed_by_a_signal_ends_its_launch_by_that_signal(tmp_path):
    path = script(tmp_path, "term.py", "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    for w in (True, False):
        assert launch([], script=path, warm=w, log_dir=tmp_path / str(w)).returncode == -signal.SIGTERM


# Rank 0 forks a child (as a loader worker is started) that says so when SIGTERM reaches it; rank 1 then fails,
# and torchrun stops rank 0 with SIGTERM to rank 0's process group: the child must get it too.
RANK_WITH_A_CHILD = '''
import os, signal, sys, time
out = sys.argv[1]
if os.environ["RANK"] == "0":
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, lambda *_: (open(os.path.join(out, "child_got_sigterm"), "w").close(),
                                                  os._exit(0)))
        open(os.path.join(out, "child_ready"), "w").close()
        time.sleep(60)
        os._exit(0)
    time.sleep(60)
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "child_ready")) and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(1)
'''


def test_torchruns_signal_to_a_ranks_group_reaches_the_ranks_children_warm_as_plain(tmp_path):
    path = script(tmp_path, "rank.py", RANK_WITH_A_CHILD)
    for w in (True, False):
        out = tmp_path / f"warm_{w}"
        out.mkdir()
        one = start([str(out)], script=path, nproc=2, warm=w, log_dir=out)
        assert one.warm is w
        done = one.finish(90)
        assert done.returncode == 1, done.output[-3000:]
        assert (out / "child_got_sigterm").exists(), f"warm={w}: rank 0's child never got torchrun's SIGTERM"
        assert not done.left, done.left


def test_a_launch_setting_what_torch_reads_as_it_is_imported_otherwise_starts_plain(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    reads = script(tmp_path, "reads.py", "import sys\npreloaded = 'torch' in sys.modules\nimport torch._dynamo\n"
                                         "print(preloaded, torch._dynamo.config.disable)\n")
    says = script(tmp_path, "says.py", "import sys\nprint('torch' in sys.modules)\n")
    envs = {"disabled": (reads, {"TORCH_COMPILE_DISABLE": "1"}),
            "threads": (says, {"OMP_NUM_THREADS": "2"}),  # read by OpenMP as torch loads it, unseen by os.environ
            # torch's own default, which importing torch._dynamo sets in any process (here too): still warm
            "default_cache": (reads, {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(default_cache_dir())})}
    said = {}
    for name, (path, env) in envs.items():
        done = launch([], script=path, env=env, log_dir=tmp_path / name)
        assert done.returncode == 0, done.output
        said[name] = done.stdout.strip()
    assert said == {"disabled": "False True", "threads": "False", "default_cache": "True False"}


def test_a_launch_whose_server_died_runs_plain(tmp_path, monkeypatch, capsys):
    # The client finds no server at its socket (the server is gone): it becomes a plain python, same command line.
    dead = tmp_path / "dead.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(dead))
    listener.close()
    path = script(tmp_path, "plain.py", "import sys\nprint('torch' in sys.modules, sys.argv[1:])\nsys.exit(4)\n")
    one = start(["an arg"], script=path, env={warm.SOCKET_ENV: str(dead)}, log_dir=tmp_path)
    done = one.finish(60)
    assert one.warm and (done.returncode, done.stdout.strip()) == (4, "False ['an arg']"), done.output
    # pytest's side: a server that has died makes every later launch plain, said once.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(warm, "_servers", [gone] * warm.SERVERS)
    monkeypatch.setattr(warm, "_failed", None)
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    assert warm.command(launcher) is None and warm.command(launcher) is None
    said = capsys.readouterr().err
    assert said.count("launches start plain python processes from now on") == 1 and "server0.sock" in said, said


STAND_IN = '''
import os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

from helpers import warm

with ThreadPoolExecutor(1) as pool:  # the servers' starting thread ends with the pool
    assert pool.submit(warm._ready).result()
served = subprocess.run([str(warm._client()), sys.argv[1]], env={**os.environ, "OMP_NUM_THREADS": "1", **warm.env()},
                        capture_output=True, text=True, timeout=60)
print(warm.WARM_DIR, " ".join(str(server.pid) for server in warm._servers), served.stdout.strip())
'''


def test_a_server_serves_after_its_starting_thread_ended_and_ends_with_its_process(tmp_path):
    """A parent-death signal fires when the thread that started the process ends: a server started from a pool's
    thread died with it, and every later launch failed. The server watches its parent process instead."""
    said = script(tmp_path, "said.py", "import os\nprint(os.getppid())\n")  # a fork's parent: its server
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
           "GRAPHED_DDP_TEST_WARM_PRELOAD": ""}  # helpers/warm_python.py: a server that imports nothing
    done = subprocess.run([sys.executable, "-c", STAND_IN, said], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    folder, *pids, parent = done.stdout.split()
    servers = [int(pid) for pid in pids]
    try:
        assert len(servers) == warm.SERVERS and int(parent) == servers[0], done.stdout  # served by a fork
        assert gone_within(servers, 10), "servers alive 10 s after the process that started them ended"
    finally:
        kill(servers)
        shutil.rmtree(folder, ignore_errors=True)


def gone_within(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(is_live(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(is_live(pid) for pid in pids)


FORKS_AND_SLEEPS = '''
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
open(sys.argv[1], "w").write(f"{os.getpid()} {child}")
if sys.argv[2] == "leave":
    os._exit(0)
time.sleep(60)
'''


def test_a_warm_launchs_processes_are_found_killed_with_its_client_and_named_when_left(tmp_path):
    path = script(tmp_path, "forks.py", FORKS_AND_SLEEPS)
    pids = tmp_path / "pids"
    running = start([str(pids), "stay"], script=path, log_dir=tmp_path / "running")
    running.wait_until(lambda: pids.exists() and pids.read_text(), "the script's pids")
    fork, child = map(int, pids.read_text().split())
    assert {running.proc.pid, fork, child} == set(running.pids())  # by the launch's mark, in /proc
    os.kill(running.proc.pid, signal.SIGKILL)  # the client: its server then kills the fork's group
    assert gone_within([fork, child], 10)
    running.proc.wait()

    pids.unlink()  # a fork that ends, leaving its child: still found, by the mark it inherited, and named
    left = start([str(pids), "leave"], script=path, log_dir=tmp_path / "left")
    assert left.proc.wait(timeout=60) == 0
    fork, child = map(int, pids.read_text().split())
    named = cmdline(child)
    assert left.pids() == [child] and "forks.py" in named and named.endswith("leave"), (left.pids(), named)
    left.kill()
    assert gone_within([child], 10)
