"""Stands where ``python`` stands in a launch and runs the script in a fork of the warm server
(helpers/warm_python.py): passes it this process's command line, environment, folder and standard streams,
relays the signals it gets, and ends as the fork ended. Standard library only: it starts in milliseconds.

    warm_client.py train.py key=value ...      # as ``python train.py key=value ...``
    warm_client.py -m package.module args ...  # as ``python -m package.module args ...``
"""
import json
import os
import signal
import socket
import struct
import sys

RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


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


def main():
    # How this process found its signals (what python would have kept across the exec), for the fork.
    # The relayed signals are held until the fork is known, then relayed to it.
    ignored = [int(sig) for sig in RELAYED if signal.getsignal(sig) == signal.SIG_IGN]
    blocked = [int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)]
    # Two servers, each with its own string-hash seed: neighbouring ranks fork from different ones, so that, as
    # in separate interpreters, they do not iterate a set of strings in the same order by chance.
    servers = os.environ["GRAPHED_DDP_TEST_WARM_SOCKET"].split(os.pathsep)  # helpers.warm.SOCKET_ENV
    rank = os.environ.get("RANK", "")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(servers[int(rank) % len(servers) if rank.isdigit() else 0])
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "ignored": ignored,
                          "blocked": blocked}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(request)) + request], streams())
    (pid,) = struct.unpack("!i", recv_exact(conn, 4))

    def relay(sig, _frame):
        try:
            os.kill(pid, sig)
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
