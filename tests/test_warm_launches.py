"""The tests' warm launches (tests/helpers/warm.py) against plain interpreters: what a script sees and how it ends
are the same, a rank of each pair forks from its own server, and no process of a warm launch escapes the tests'
bookkeeping (found while it runs, killed with its client, named when left behind)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers import warm
from helpers.launches import launch, start
from helpers.processes import cmdline, is_live

pytestmark = pytest.mark.skipif(not warm.wanted({}), reason="launches are warm only without CUDA and without "
                                                            "GRAPHED_DDP_TEST_WARM=0")

SEES = '''
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "given": os.environ.get("GIVEN"), "rank": os.environ.get("RANK"), "hash": hash("a string"),
                  "sigint_ignored": __import__("signal").getsignal(2) == __import__("signal").SIG_IGN}))
sys.stdout.flush()
sys.exit(int(os.environ.get("CODE", "0")))
'''


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("code", [0, 3])
def test_a_script_sees_and_ends_as_under_a_plain_python(tmp_path, code):
    path = script(tmp_path, "sees.py", SEES)
    runs = {w: launch(["one", "two words"], script=path, cwd=tmp_path, env={"GIVEN": "yes", "CODE": str(code)},
                      warm=w, log_dir=tmp_path / str(w)) for w in (True, False)}
    seen = {w: json.loads(run.stdout) for w, run in runs.items()}
    for w, run in runs.items():
        assert run.returncode == code, run.output
        assert not run.left, run.left
    hot, cold = seen[True], seen[False]
    assert hot["hash"] != cold["hash"]  # different interpreters (a fork has its server's seed)
    hot.pop("hash"), cold.pop("hash")
    # SIGINT ignored where this suite runs with it ignored (a CI runner's `cmd &`): kept across the exec, as by a fork
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert hot == cold == {"argv": [path, "one", "two words"], "cwd": str(tmp_path), "path0": str(tmp_path),
                           "name": "__main__", "given": "yes", "rank": None, "sigint_ignored": ignored}


def test_a_script_killed_by_a_signal_ends_its_launch_by_that_signal(tmp_path):
    path = script(tmp_path, "term.py", "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    for w in (True, False):
        assert launch([], script=path, warm=w, log_dir=tmp_path / str(w)).returncode == -signal.SIGTERM


def test_two_warm_ranks_fork_from_servers_with_their_own_string_hashes(tmp_path):
    # Each rank writes a file of its own: two ranks' lines on one stdout can interleave.
    path = script(tmp_path, "hashes.py", 'import os, sys\nopen(os.path.join(sys.argv[1], os.environ["RANK"]), "w")'
                                         '.write(str(hash("a string")))\n')
    run = launch([str(tmp_path)], script=path, nproc=2, timeout=60)
    assert run.returncode == 0, run.output
    assert (tmp_path / "0").read_text() != (tmp_path / "1").read_text()


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
    assert {fork, child} <= set(running.pids())  # the fork by its server's record, its child by its session
    os.kill(running.proc.pid, signal.SIGKILL)  # the client: its server then kills the fork's session
    assert gone_within([fork, child], 10)
    running.proc.wait()

    pids.unlink()  # a fork that ends, leaving its child: still found, by the session it started, and named
    left = start([str(pids), "leave"], script=path, log_dir=tmp_path / "left")
    assert left.proc.wait(timeout=60) == 0
    fork, child = map(int, pids.read_text().split())
    named = cmdline(child)
    assert left.pids() == [child] and "forks.py" in named and named.endswith("leave"), (left.pids(), named)
    left.kill()
    assert gone_within([child], 10)
