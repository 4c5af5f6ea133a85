"""How a rank's DataLoader workers start, wait and end: the host loader's, and those that read a
dataset whole for the device loader (trainer/data/items.py). Every loader here takes its worker
arguments from ``worker_options``.

Start (``recipe.data.worker_start``): by a forkserver by default (spawn where there is none). A
worker forked from the rank itself inherits every lock the rank's other threads held at that
instant (tqdm's monitor writing to stderr, a thread pool, a queue feeder, the warnings module):
one it needs later never opens, and the rank waits on it forever. The forkserver is a process of
one thread that imports torch once and forks every worker from that clean state: its import
costs the rank's first loader about 2.3 s on a 2-core machine (spawn costs that for every
loader), each later loader about 0.1 s. It is started as soon as a loader is made, so the import
overlaps the rest of the build. ``fork`` stays available for datasets that cannot be pickled.

Wait (``recipe.data.worker_timeout_s``): a loader whose workers send nothing for that long ends
the rank's wait with ``LoaderStuck``, naming the workers, instead of waiting forever; a worker that
died ends it within ``LIVENESS_CHECK_S``, named by DataLoader.

End: a worker ends when its rank says so (DataLoader's shutdown; multiprocessing's exit handler,
which terminates the workers still alive when the rank exits), or when its rank is gone, however
it was started; never on a signal of its own. SIGINT and SIGTERM reach a whole process group
(Ctrl-C, torchrun stopping its ranks, SLURM preemption), and a worker ended by one makes DataLoader
raise in its rank ("worker killed by signal") wherever the rank is, in the middle of an orderly
SIGTERM stop too: so the worker blocks both, and a thread of its own takes each SIGTERM, ending the
worker only when the rank sent it. A worker forked from the rank also holds copies of the rank's
sockets (gloo's connections to the other ranks); it gets the parent-death signal, so that the other
ranks learn at once that a killed rank is gone. Any other worker (a forkserver's or spawn's child,
whose parent is not the rank) watches the rank's pid itself.
"""
from __future__ import annotations

import ctypes
import functools
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

import torch

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class WorkerSettings:
    start: str = "forkserver"  # forkserver | spawn | fork (recipe.data.worker_start)
    timeout_s: float = 300.0  # recipe.data.worker_timeout_s


_settings = WorkerSettings()


def use_worker_settings(settings: WorkerSettings, *, start_now_for: Optional[str] = None) -> None:
    """The run's worker settings, set once at build, before any loader is made. ``start_now_for``: the module
    of the datasets that workers will read; the forkserver then starts now, importing while the rank builds."""
    global _settings
    _settings = settings
    if start_now_for is not None:
        _context(start_now_for)


LIVENESS_CHECK_S = 5.0  # how often a waiting rank asks whether its workers are alive (batches)
MAX_WORKERS = 32  # a bound on the workers chosen for the user (each holds a copy of the reader's state)


def cores_per_rank() -> int:
    """This rank's share of the cores it may run on: the ranks of one node (LOCAL_WORLD_SIZE) read at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def loader_workers(num_workers: Optional[int]) -> int:
    """``recipe.data.num_workers`` as the loaders take it: a number as given; null, this rank's share of the cores
    less the one its training loop runs on (at most MAX_WORKERS; 0 on a single core). 15 on a 16-core machine with
    one GPU: an image folder's decoding is what keeps such a step fed (docs/data.md, "Which decoder")."""
    if num_workers is not None:
        return num_workers
    return min(MAX_WORKERS, cores_per_rank() - 1)


class LoaderStuck(RuntimeError):
    """A loader's workers sent no batch for ``recipe.data.worker_timeout_s``."""


def worker_options(num_workers: int, dataset: object) -> Dict[str, Any]:
    """DataLoader's worker arguments for workers started from this process (the rank) to read ``dataset``."""
    if num_workers == 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "multiprocessing_context": _context(type(dataset).__module__),
            "worker_init_fn": functools.partial(_worker_init, os.getpid()),
            "timeout": min(_settings.timeout_s, LIVENESS_CHECK_S)}


def _context(dataset_module: str):
    start = _settings.start
    if start not in torch.multiprocessing.get_all_start_methods():  # no forkserver (Windows): spawn it is
        start = "spawn"
    context = torch.multiprocessing.get_context(start)
    if start != "fork":
        # __main__ carries sys.path to the server; the rest is what every worker imports to unpickle what it reads.
        context.set_forkserver_preload(["__main__", "torch", __name__, "trainer.data.items", dataset_module])
        _start_helpers(start)
    return context


def _start_helpers(start: str) -> None:
    """Starts multiprocessing's resource tracker (which a forkserver's or spawn's queues register with) and the
    forkserver now, from here. The tracker's start unblocks SIGINT and SIGTERM in the thread that starts it, where
    the rank keeps them blocked for its stop thread (trainer/run/stop.py): a SIGTERM would then kill the rank outright,
    without its checkpoint; the mask is put back. It would also warn of "leaked semaphore objects" after every rank
    that ends by ``os._exit`` (they are freed all the same): that warning is left out of its options."""
    from multiprocessing import forkserver, resource_tracker

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else None
    options = list(sys.warnoptions)
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions[:] = options
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if start == "forkserver":
        # Started with the rank's mask back in place: a server that took the process group's SIGTERM would die
        # (its workers with it) while the rank still reads from them, and the rank's orderly stop would wait on
        # batches that never come. It ends when the rank does (its pipe from the rank closes).
        forkserver.ensure_running()  # returns at once; the server imports while the rank goes on


def batches(loader: torch.utils.data.DataLoader, iterator: Optional[Iterator] = None, *, what: str) -> Iterator:
    """The batches of ``loader`` (or of its ``iterator``), a wait of ``recipe.data.worker_timeout_s`` raised as
    ``LoaderStuck`` naming ``what`` the workers read and their pids.

    The loader's own timeout is a slice of that wait (``LIVENESS_CHECK_S``): at the end of each slice DataLoader
    looks for dead workers and raises naming them, so that a worker killed from outside ends the wait in
    seconds rather than after the whole timeout. A timed-out wait changes nothing in the iterator; it waits again."""
    iterator = iter(loader) if iterator is None else iterator
    began = time.monotonic()
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except RuntimeError as e:
            if not str(e).startswith("DataLoader timed out"):  # torch's words for a wait past ``timeout``
                raise
            if time.monotonic() - began < _settings.timeout_s:
                continue  # one slice of the wait: DataLoader found no dead worker
            pids = ", ".join(str(w.pid) for w in getattr(iterator, "_workers", []))
            raise LoaderStuck(
                f"the DataLoader workers reading {what} (pids {pids}) sent no batch for {_settings.timeout_s:g} s: "
                "one is stuck or far too slow. Set recipe.data.num_workers=0 to read in the rank itself and see "
                "where it stops, or raise recipe.data.worker_timeout_s for items that take that long") from e
        yield item
        began = time.monotonic()  # the next batch's wait starts when the loop asks for it


def end_workers(iterator: Optional[Iterator]) -> None:
    """Ends a DataLoader iterator's worker processes now (a no-op for one without workers, or already ended).
    After a failure too: the exception's traceback holds the iterator, in a cycle that only the garbage collector
    frees, and DataLoader's shutdown run from there waited 5 s on each worker."""
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def _worker_init(rank_pid: int, _worker_id: int) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # before any thread: they inherit it
    if os.getppid() == rank_pid and sys.platform.startswith("linux"):  # forked from the rank: die with it
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl here: the watcher below it is
            pass
        if os.getppid() != rank_pid:  # the rank died before the line above
            os._exit(1)
    threading.Thread(target=_end_with_rank, args=(rank_pid,), name="end-with-rank", daemon=True).start()
    if hasattr(signal, "sigwaitinfo"):
        threading.Thread(target=_end_when_rank_terminates, args=(rank_pid,), name="rank-sigterm", daemon=True).start()


def _end_with_rank(rank_pid: int) -> None:
    """Ends this worker as soon as the rank's process is gone (a pidfd becomes readable when it exits)."""
    try:
        pidfd = os.pidfd_open(rank_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): ask once a second
        while _alive(rank_pid):
            time.sleep(1.0)
        os._exit(1)
    select.select([pidfd], [], [])
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


def _end_when_rank_terminates(rank_pid: int) -> None:
    """Takes every SIGTERM sent to this worker (blocked in all its threads): the rank's own (its DataLoader
    shutting workers down, multiprocessing's exit handler) ends it; any other is the process group's, ignored."""
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == rank_pid:
            os._exit(0)
