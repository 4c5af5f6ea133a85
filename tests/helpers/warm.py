"""Whether a launch runs its Python processes in forks of a warm server, and the servers themselves.

On a machine without CUDA a launch's ``python`` (and torchrun's, and each rank's) is ``helpers/warm_client.py``
running the script in a fork of a server that imported torch, torch._dynamo and Hydra once for the session
(helpers/warm_python.py says how, and what stays as before): a two-rank launch then costs about 1 s of CPU to
start, not about 9. Two servers, each with its own string-hash seed, so that neighbouring ranks differ in it as
separate interpreters do.

Plain interpreters start on a machine with CUDA (the GPU tests run as a user does), with
``GRAPHED_DDP_TEST_WARM=0`` (a whole session), with ``warm=False`` (one launch: helpers.launches.Launch; the
tests about signals, workers and process lifetime pass it), and once a server could not start or has died (said
once). Each client also becomes a plain python itself where a fork cannot be a fresh one: what Python reads only
as it starts, or what torch reads as it is imported (TORCH_LOGS, TORCHINDUCTOR_*, OMP_NUM_THREADS, ...), set
otherwise than the server had it; or its server gone.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from helpers.paths import ROOT
from helpers.processes import MARK, SESSION, WARM_COMMAND, launch_marked

SOCKET_ENV = "GRAPHED_DDP_TEST_WARM_SOCKET"
START_TIMEOUT_S = 120.0  # the server's imports, on a loaded 2-core machine
WARM_DIR = Path(tempfile.gettempdir()) / f"graphed_ddp_test_warm_{SESSION}"  # the sockets, the client, the logs

SERVERS = 2  # each its own string-hash seed: ranks 0 and 1 fork from different ones (helpers/warm_client.py)
# Room in a server's environment for a fork to write its launch's over it (helpers/warm_python.py).
ROOM = {"GRAPHED_DDP_TEST_WARM_ROOM": "." * 16384}

_BASE = dict(os.environ)  # the session's environment, not a test's monkeypatched one, is what the servers get
_servers: List[subprocess.Popen] = []
_failed: Optional[str] = None
_starting = threading.Lock()


def _server_env() -> Dict[str, str]:
    return launch_marked({**_BASE, "OMP_NUM_THREADS": "1", **ROOM})[0]  # found, and killed, with the session's


def enabled() -> bool:
    """Whether this session's launches run warm: not with ``GRAPHED_DDP_TEST_WARM=0``, nor with CUDA."""
    if os.environ.get("GRAPHED_DDP_TEST_WARM", "1") == "0":
        return False
    import torch

    return not torch.cuda.is_available()


def _sockets() -> List[Path]:
    return [WARM_DIR / f"server{i}.sock" for i in range(SERVERS)]


def _client() -> Path:
    """The client as an executable file whose first line runs this interpreter without site (-S): torchrun's
    ``--no-python`` runs it as each rank's command."""
    path = WARM_DIR / "python"
    if not path.exists():
        source = (ROOT / "tests" / "helpers" / "warm_client.py").read_text()
        temp = path.with_suffix(".tmp")
        temp.write_text(f"#!{sys.executable} -S\n{source}")
        temp.chmod(0o755)
        temp.rename(path)
    return path


def _give_up(why: str) -> bool:
    global _failed
    _failed = why
    print(f"tests: {why}; launches start plain python processes from now on", file=sys.stderr, flush=True)
    return False


def _ready() -> bool:
    """Starts the servers once a session, from whichever thread asks first (each watches this process, not the
    thread); waits for their sockets. False (said once) once one cannot start or has died."""
    with _starting:  # launches in several threads (the fault table's) start one pair
        if _failed is not None:
            return False
        if not _servers:
            WARM_DIR.mkdir(parents=True, exist_ok=True)
            server = ROOT / "tests" / "helpers" / "warm_python.py"
            for sock in _sockets():
                with open(sock.with_suffix(".log"), "w") as log:
                    _servers.append(subprocess.Popen(
                        [sys.executable, str(server), str(sock), str(os.getpid()), MARK, WARM_COMMAND], cwd=WARM_DIR,
                        env=_server_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        start_new_session=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        for server, sock in zip(_servers, _sockets()):
            while server.poll() is None and not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            if server.poll() is not None or not sock.exists():
                log = sock.with_suffix(".log").read_text()[-2000:]
                return _give_up(f"the warm server {sock.name} {'died' if sock.exists() else 'did not start'} "
                                f"(exit {server.poll()}):\n{log}")
        return True


def command(launcher: List[str]) -> Optional[List[str]]:
    """``launcher`` (``[python]`` or torchrun's ``[python, -m, torch.distributed.run, flags...]``) with each
    Python process a warm fork, or None where the launch stays plain (``enabled``, the servers up)."""
    if not enabled() or not _ready():
        return None
    client = str(_client())
    if launcher == [sys.executable]:
        return [client]
    assert launcher[:3] == [sys.executable, "-m", "torch.distributed.run"], launcher
    return [client, *launcher[1:], "--no-python", client]


def env() -> Dict[str, str]:
    return {SOCKET_ENV: os.pathsep.join(str(s) for s in _sockets())}


def close() -> None:
    """Ends the servers (their forks are launches, ended with them) and removes their folder."""
    for server in _servers:
        server.kill()
        server.wait()
    shutil.rmtree(WARM_DIR, ignore_errors=True)
