"""Whether a launch runs its Python processes in forks of a warm server, and the servers themselves.

On a machine without CUDA every launch's ``python`` (and torchrun's, and each rank's) is
``helpers/warm_client.py`` running the script in a fork of a server that imported torch, torch._dynamo and
Hydra once for the session (helpers/warm_python.py says how, and what stays as before): a two-rank launch
then costs about 1 s of CPU to start, not about 9. Two servers, each with its own string-hash seed, so that
neighbouring ranks differ in it as separate interpreters do. A launch that sets what Python reads only as it
starts (``STARTUP_ONLY``, or a sitecustomize on its PYTHONPATH) starts a plain python, as does every launch
on a machine with CUDA (the GPU tests run as a user does), with ``GRAPHED_DDP_TEST_WARM=0`` (a whole
session) or with ``warm=False`` (one launch: helpers.launches.Launch).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from helpers.paths import ROOT
from helpers.processes import MARK, SESSION, WARM_DIR

SOCKET_ENV = "GRAPHED_DDP_TEST_WARM_SOCKET"
START_TIMEOUT_S = 120.0  # the server's imports, on a loaded 2-core machine

SERVERS = 2  # each its own string-hash seed: ranks 0 and 1 fork from different ones (helpers/warm_client.py)
# What Python reads only as it starts, which a fork of a started interpreter cannot honour: a launch that sets
# one (or puts a sitecustomize on its PYTHONPATH) starts a plain python.
STARTUP_ONLY = ("PYTHONPROFILEIMPORTTIME", "PYTHONSTARTUP", "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONFAULTHANDLER",
                "PYTHONTRACEMALLOC", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONIOENCODING", "PYTHONUTF8",
                "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONHOME", "PYTHONINSPECT", "PYTHONOPTIMIZE")

_servers: List[subprocess.Popen] = []
_failed: Optional[str] = None


def wanted(env: Dict[str, str]) -> bool:
    """Whether a launch with ``env`` (its additions to this process's environment) runs warm."""
    if os.environ.get("GRAPHED_DDP_TEST_WARM", "1") == "0":
        return False
    full = {**os.environ, **env}
    if any(name in full for name in STARTUP_ONLY):
        return False
    if any((Path(p) / hook).exists() for p in full.get("PYTHONPATH", "").split(os.pathsep) if p
           for hook in ("sitecustomize.py", "usercustomize.py")):
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


def _ready() -> bool:
    """Starts the servers once a session; waits for their sockets. False (said once) if they cannot start."""
    global _failed
    if _failed is not None:
        return False
    if not _servers:
        (WARM_DIR / "forks").mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in STARTUP_ONLY}
        env.update({"OMP_NUM_THREADS": "1", MARK: f"{SESSION}-warm-server"})
        server = ROOT / "tests" / "helpers" / "warm_python.py"
        for sock in _sockets():
            with open(sock.with_suffix(".log"), "w") as log:
                _servers.append(subprocess.Popen([sys.executable, str(server), str(sock), str(os.getpid())],
                                                 cwd=WARM_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + START_TIMEOUT_S
    for server, sock in zip(_servers, _sockets()):
        while not sock.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                _failed = sock.with_suffix(".log").read_text()[-2000:]
                print(f"tests: the warm server did not start; launches start plain python processes:\n{_failed}",
                      file=sys.stderr, flush=True)
                return False
            time.sleep(0.02)
    return True


def command(launcher: List[str], env: Dict[str, str]) -> Optional[List[str]]:
    """``launcher`` (``[python]`` or torchrun's ``[python, -m, torch.distributed.run, flags...]``) with each
    Python process a warm fork, or None where the launch stays plain (``wanted``)."""
    if not wanted(env) or not _ready():
        return None
    client = str(_client())
    if launcher == [sys.executable]:
        return [client]
    assert launcher[:3] == [sys.executable, "-m", "torch.distributed.run"], launcher
    return [client, *launcher[1:], "--no-python", client]


def env() -> Dict[str, str]:
    return {SOCKET_ENV: os.pathsep.join(str(s) for s in _sockets())}
