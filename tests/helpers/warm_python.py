"""A warm interpreter for the tests' launches: torch, torch._dynamo and Hydra imported once, each process forked.

A launch's Python process (``python train.py ...``, or each rank torchrun starts) spends about 3.5 s of CPU
importing torch, torch._dynamo (which every optimizer's constructor pulls in) and Hydra before it runs a line
of ours: on the 2-core machines the suite runs on, most of a small launch. This server imports them once, then
forks a process for each request of ``helpers/warm_client.py``, which stands where ``python`` stood (for
torchrun, as its ``--no-python`` entry point): the client passes its command line, environment, working folder,
umask and standard streams; the fork takes them, starts a session of its own, reseeds the random generators its
server seeded, and runs the script as ``python`` would (``runpy``, ``__main__``, the script's folder first on
``sys.path``, then PYTHONPATH's). Everything else is as before: torchrun is torchrun, a rank is a process of its
own with its own gloo group, and the client relays the signals it gets to the fork's process group (where a
plain rank's loader workers would get them) and ends with its exit status (or dies by its signal). When the
client dies (torchrun killed it), the server kills the fork's process group, as the kill would have.

Only third-party modules are preloaded, never this checkout's (a test may run train.py from a copy). The
server notes which environment variables its imports read, with their values (``write_reference``): a client
whose environment differs in one of them starts a plain python instead (helpers/warm_client.py). A fork
writes its launch's environment over its server's in the memory /proc shows as its environ (the server starts
with room for it), so scripts/lib/process_tree.py finds a fork, and what it forks, by the launch's marker like
any process; the command its client was given stands there too, for naming it (helpers.processes.cmdline).
The server ends when the process that started it does (it watches its parent process, not a thread).

    python tests/helpers/warm_python.py SOCKET PARENT_PID MARK COMMAND   # by helpers/warm.py, twice a session
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
# Another list (comma-separated) in the server's environment: tests/test_warm_launches.py's lifetime test starts a
# server that preloads nothing.
PRELOAD_ENV = "GRAPHED_DDP_TEST_WARM_PRELOAD"
MAX_REQUEST = 1 << 22
# Read as C libraries load (the OpenMP and MKL thread pools), where os.environ does not see it: a launch that
# sets one of these otherwise starts plain (helpers/warm_client.py).
LOADED_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "LD_PRELOAD")
HANDLED = ("PYTHONUNBUFFERED",)  # read by the imports, and taken from the launch by ``become``
# Signals whose disposition an exec keeps when ignored; a fork takes them as the client found them.
INHERITED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
PARENT_CHECK_S = 1.0  # how soon the server sees that the process that started it is gone


def environ_block() -> memoryview:
    """The memory that /proc/PID/environ shows (the environment this process started with, which a fork keeps):
    its address from this process's stat (fields 50 and 51), which psutil does not give."""
    import ctypes

    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])
    return memoryview((ctypes.c_char * (end - start)).from_address(start)).cast("B")


def show_environment(block: memoryview, env: dict, first: list) -> None:
    """In a fork: ``env``, the names in ``first`` first, written over the server's environment as far as it fits,
    so that /proc shows the launch's. Nothing reads that memory any more: the C library's environment was
    rebuilt elsewhere by os.environ's clear and update."""
    data = bytearray()
    for name in [*(n for n in first if n in env), *(n for n in env if n not in first)]:
        entry = os.fsencode(f"{name}={env[name]}") + b"\0"
        if len(data) + len(entry) <= len(block):
            data += entry
    block[:] = bytes(data) + bytes(len(block) - len(data))


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


def preload(names) -> set:
    """Imports ``names``; returns the names of the environment variables those imports asked for by name (not
    those a sweep over the whole environment, tqdm's for its TQDM_* settings say, went past)."""
    import importlib

    read = set()
    sweeps = []
    get, iterate = os._Environ.__getitem__, os._Environ.__iter__  # os.environ[...], .get, ``in``, os.getenv; items()

    def recording(environ, name):
        if not sweeps:
            read.add(name)
        return get(environ, name)

    def sweeping(environ):
        sweeps.append(None)
        try:
            yield from iterate(environ)
        finally:
            sweeps.pop()

    os._Environ.__getitem__, os._Environ.__iter__ = recording, sweeping
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        os._Environ.__getitem__, os._Environ.__iter__ = get, iterate
    return read


def write_reference(path: str, before: dict, read: set) -> None:
    """What a launch must leave as it was for a fork to be what a fresh python would be: each variable the imports
    read, or of ``LOADED_PREFIXES``, with its value before the imports and after them (torch sets some itself,
    TORCHINDUCTOR_CACHE_DIR to its default: a launch may carry either). helpers/warm_client.py reads it."""
    after = dict(os.environ)
    names = {n for n in {*before, *after} if n.startswith(LOADED_PREFIXES)} | (read - set(HANDLED))
    reference = {"names": {n: [before.get(n), after.get(n)] for n in sorted(names)}, "prefixes": LOADED_PREFIXES}
    Path(path + ".tmp").write_text(json.dumps(reference))
    os.rename(path + ".tmp", path)


def kill_group(leader: int) -> None:
    """SIGKILL to the process group a fork leads (it, and what it started that did not leave its group)."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(socket_path: str, parent: int):
    """Serves forks until the process ``parent`` ends; returns (in a fork only) the request that fork is to run.
    Its parent is watched here rather than by a parent-death signal, which fires when the *thread* that started
    the server ends (a pool's thread, say)."""
    before = dict(os.environ)
    listed = os.environ.get(PRELOAD_ENV)
    read = preload(PRELOAD if listed is None else list(filter(None, listed.split(","))))
    write_reference(socket_path + ".json", before, read)
    import gc
    import threading

    assert threading.active_count() == 1, "a thread started while preloading: forking would be unsafe"
    # What the imports made is never collected, so a fork's collections (and its exit) do not touch those
    # pages: without this each fork copies most of the server's heap as it ends (1 s of a 1.1 s fork).
    gc.collect()
    gc.freeze()
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
    while os.getppid() == parent:
        try:
            readable, _, _ = select.select([listener, wake_r, *(c for c in clients.values() if c)], [], [],
                                           PARENT_CHECK_S)
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
            if conn is not None and conn in readable:  # the client is gone (killed): as if it were the fork
                kill_group(pid)
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
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            listener.close()
            for other in clients.values():
                if other is not None:
                    other.close()
            return request, fds, conn
        for fd in fds:
            os.close(fd)
        clients[pid] = conn  # the fork sends the client its pid, once it leads a group that the client can signal
    os._exit(0)  # the process that started this server is gone; its forks run on, as launches would


def reseed() -> None:
    """New seeds for the generators the server's imports seeded from the system's entropy, which every fork
    would otherwise share (a fresh interpreter draws its own): Python's ``random``, numpy's and torch's."""
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def become(request, fds, conn: socket.socket, block: memoryview, mark_name: str, command_name: str) -> None:
    """In the fork: the client's session, streams, folder, umask, environment and command line; then its script."""
    import io
    import runpy

    os.setsid()
    conn.sendall(struct.pack("!i", os.getpid()))
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    argv = request["argv"]
    show_environment(block, {**env, command_name: " ".join(argv)[:300].replace("\n", " ")}, [mark_name, command_name])
    reseed()
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
    # Read before the imports: a fork writes its launch's environment where its server's started.
    environment = environ_block()
    forked = serve(sys.argv[1], int(sys.argv[2]))
    become(*forked, environment, mark_name=sys.argv[3], command_name=sys.argv[4])
