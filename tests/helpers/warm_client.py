"""Stands where ``python`` stands in a launch and runs the script in a fork of the warm server
(helpers/warm_python.py): passes it this process's command line, environment, folder, umask and standard
streams, relays the signals it gets to the fork's process group, and ends as the fork ended. Standard library
only: it starts in milliseconds.

It becomes a plain python with the same command line (exec) where a fork could not be what a fresh python
would be: where its environment sets what Python reads only as it starts (``STARTUP_ONLY``, a sitecustomize
on PYTHONPATH) or what the server's imports read (TORCH_LOGS, TORCH_COMPILE_DISABLE, TORCHINDUCTOR_*,
OMP_NUM_THREADS, ...: the server lists them) otherwise than the server had it, and where no server answers (it
died).

    warm_client.py train.py key=value ...      # as ``python train.py key=value ...``
    warm_client.py -m package.module args ...  # as ``python -m package.module args ...``

A signal reaches this process alone (torchrun's ``killpg`` of a rank, a test's of its launch: this process
leads a group of one), while under a plain python it would reach the rank and every process of its group (its
loader workers, a forkserver). The fork leads a group of its own, so each relayed signal goes to that group. A
signal sent to this process's pid alone cannot be told from one sent to its group: it reaches the group too.
"""
import json
import os
import signal
import socket
import struct
import sys

RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# What Python reads only as it starts, which a fork of a started interpreter cannot honour.
STARTUP_ONLY = ("PYTHONPROFILEIMPORTTIME", "PYTHONSTARTUP", "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONFAULTHANDLER",
                "PYTHONTRACEMALLOC", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONIOENCODING", "PYTHONUTF8",
                "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONHOME", "PYTHONINSPECT", "PYTHONOPTIMIZE")


def recv_exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise SystemExit("warm_client: the warm server closed the connection (was it killed?)")
        data += chunk
    return data


def streams():
    """This process's standard streams' descriptors, /dev/null's for any that is closed."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def fork_differs(server):
    """Whether this process's environment asks for what a fork of ``server`` cannot be (or no server is there)."""
    env = os.environ
    if any(name in env for name in STARTUP_ONLY):
        return True
    if any(os.path.exists(os.path.join(folder, hook)) for folder in env.get("PYTHONPATH", "").split(os.pathsep)
           if folder for hook in ("sitecustomize.py", "usercustomize.py")):
        return True
    try:
        with open(server + ".json") as f:  # helpers/warm_python.py write_reference
            reference = json.load(f)
    except (OSError, ValueError):
        return True
    names = reference["names"]
    prefixes = tuple(reference["prefixes"])
    return any(env.get(name) not in names.get(name, (None,))
               for name in {*names, *(n for n in env if n.startswith(prefixes))})


def main():
    # How this process found its signals (what python would have kept across the exec), for the fork.
    # The relayed signals are held until the fork is known, then relayed to it.
    ignored = [int(sig) for sig in RELAYED if signal.getsignal(sig) == signal.SIG_IGN]
    blocked = [int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)]
    # Two servers, each with its own string-hash seed: neighbouring ranks fork from different ones, so that, as
    # in separate interpreters, they do not iterate a set of strings in the same order by chance.
    servers = os.environ["GRAPHED_DDP_TEST_WARM_SOCKET"].split(os.pathsep)  # helpers.warm.SOCKET_ENV
    rank = os.environ.get("RANK", "")
    server = servers[int(rank) % len(servers) if rank.isdigit() else 0]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    plain = fork_differs(server)
    if not plain:
        try:
            conn.connect(server)
        except OSError:  # the server is gone
            plain = True
    if plain:  # nothing has started yet: a plain python takes this process over
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    umask = os.umask(0)
    os.umask(umask)
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
                          "ignored": ignored, "blocked": blocked}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(request)) + request], streams())
    (pid,) = struct.unpack("!i", recv_exact(conn, 4))

    def relay(sig, _frame):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    for sig in RELAYED:
        signal.signal(sig, relay)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    (status,) = struct.unpack("!i", recv_exact(conn, 4))
    # Ended at once, as the fork did: an interpreter's exit first puts its signals back to their defaults, and a
    # SIGTERM then (torchrun stopping this rank as its peer ended) would end this process by the signal, not the
    # fork's exit code. Nothing here needs flushing.
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
