"""A warm interpreter for the tests' launches: torch, torch._dynamo and Hydra imported once, each process forked.

A launch's Python process (``python train.py ...``, or each rank torchrun starts) spends about 3.5 s of CPU
importing torch, torch._dynamo (which every optimizer's constructor pulls in) and Hydra before it runs a line
of ours: on the 2-core machines the suite runs on, most of a small launch. This server imports them once, then
forks a process for each request of ``helpers/warm_client.py``, which stands where ``python`` stood (for
torchrun, as its ``--no-python`` entry point): the client passes its command line, environment, working folder
and standard streams; the fork takes them, starts a session of its own, and runs the script as ``python``
would (``runpy``, ``__main__``, the script's folder first on ``sys.path``, then PYTHONPATH's). Everything else
is as before: torchrun is torchrun, a rank is a process of its own with its own gloo group, and the client
relays signals to it and ends with its exit status (or dies by its signal). When the client dies (torchrun
killed it), the server kills the fork's session.

Only third-party modules are preloaded, never this checkout's (a test may run train.py from a copy). A fork's
/proc environ and cmdline are the server's, so each fork is recorded in ``registry()`` with its launch's mark:
``helpers.processes.marked_pids`` finds a fork, and any process of its session, by it.

    python tests/helpers/warm_python.py SOCKET PARENT_PID   # started by helpers/warm.py, twice a session
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
from pathlib import Path

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.elastic.multiprocessing.errors", "torch.utils.data", "hydra", "omegaconf")
MARK = "GRAPHED_DDP_TEST_LAUNCH"  # helpers.processes.MARK (this file runs alone: it imports no helpers)
MAX_REQUEST = 1 << 22
# Signals whose disposition an exec keeps when ignored; a fork takes them as the client found them.
INHERITED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def registry(socket_path: str) -> Path:
    """The folder beside the socket with a file per fork, named by its pid: its launch's mark, its command line
    and its start time (helpers.processes.warm_forks reads them)."""
    return Path(socket_path).parent / "forks"


def _stat(pid: int, field: int) -> str:
    """A field of /proc/PID/stat counted after the command's name (3: session id, 19: start time); the twin of
    helpers.processes._stat, which this file, run alone and importing no helpers, cannot import."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[field]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _receive(conn: socket.socket):
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) < 4:
        head += _recv_exact(conn, 4 - len(head))
    (size,) = struct.unpack("!I", head)
    if size > MAX_REQUEST:
        raise ValueError(f"a request of {size} bytes")
    return json.loads(_recv_exact(conn, size)), fds


def die_with(parent: int) -> None:
    """SIGKILL to this server when the pytest process that started it ends, however it ends (a server left
    behind would hold its imports' memory for good)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def serve(socket_path: str):
    """Serves forks until killed; returns (in a fork only) the request that fork is to run."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import gc
    import threading

    assert threading.active_count() == 1, "a thread started while preloading: forking would be unsafe"
    # What the imports made is never collected, so a fork's collections (and its exit) do not touch those
    # pages: without this each fork copies most of the server's heap as it ends (1 s of a 1.1 s fork).
    gc.collect()
    gc.freeze()
    forks = registry(socket_path)
    forks.mkdir(parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    os.rename(socket_path + ".tmp", socket_path)  # the client connects only once the server listens
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    clients = {}  # fork pid -> the client's connection
    while True:
        try:
            readable, _, _ = select.select([listener, wake_r, *(c for c in clients.values() if c)], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
        while clients:  # reap: tell each client how its fork ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", status))
                except OSError:
                    pass
                conn.close()
        for pid, conn in list(clients.items()):
            if conn is not None and conn in readable:  # the client is gone (killed): so is its fork's session
                kill_session(pid)
                conn.close()
                clients[pid] = None
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # (fork clears the death signal: a fork outlives the server, as a launch would)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            listener.close()
            for other in clients.values():
                if other is not None:
                    other.close()
            conn.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        started = _stat(pid, 19)
        (forks / str(pid)).write_text("\n".join([request["env"].get(MARK, ""),
                                                  " ".join(request["argv"])[:300].replace("\n", " "), started]))
        conn.sendall(struct.pack("!i", pid))
        clients[pid] = conn


def kill_session(leader: int) -> None:
    """SIGKILL to every process of the session ``leader`` started (its own group and any other)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_stat(int(entry), 3)) == leader:
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, IndexError, ValueError):
                pass


def become(request, fds) -> None:
    """In the fork: the client's session, streams, folder, environment and command line; then its script."""
    import io
    import runpy

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  write_through=unbuffered, line_buffering=not unbuffered)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                  errors="backslashreplace")
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
    # As an exec'd python: what its parent ignored stays ignored (Python then installs no KeyboardInterrupt for
    # SIGINT either), the rest at their defaults; the parent's blocked signals stay blocked.
    for sig in INHERITED:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if sig in request["ignored"] else default)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    argv = request["argv"]
    base = sys.path[1:]  # the server's own folder (sys.path[0]) is not the script's
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[:] = [os.getcwd(), *extra, *base]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = list(argv)
        sys.path[:] = [os.path.dirname(script), *extra, *base]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    die_with(int(sys.argv[2]))
    forked = serve(sys.argv[1])
    become(*forked)
