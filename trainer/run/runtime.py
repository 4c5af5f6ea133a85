"""Process-level runtime: ranks, devices, the process group, the run directory, seeds.

One GPU per process. ``torch.cuda.set_device(LOCAL_RANK)`` happens before any other
CUDA work; NCCL on GPUs, gloo on CPU. The process group is destroyed on every exit
path by ``Runtime.close`` (graphs must be released before that: see graphing/).
"""
from __future__ import annotations

import datetime
import glob
import os
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from trainer.run.errors import ConfigError, RunDirInUse
from trainer.run.run_lock import RunDirLock, acquire

def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def print_once(*args, file=None) -> None:
    """Prints on rank 0 only (to stdout unless ``file`` says otherwise, looked up at call time)."""
    if env_rank() == 0:
        print(*args, file=file or sys.stdout, flush=True)


@dataclass
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    distributed: bool
    run_dir: Path
    lock: Optional["RunDirLock"] = None  # rank 0's claim on run_dir (trainer/run/run_lock.py)
    opened: bool = False  # the run directory is in use (make_run_dir): it stays when the run ends
    # Where a recipe builds its model: the host, or under train.fsdp.init=meta the meta device (a recipe that
    # supports it builds ``with torch.device(rt.init_device)`` and gives Recipe.init_weights; trainer/parallel/sharding.py)
    init_device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_object(self, obj):
        """Rank 0's value of ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def make_run_dir(self) -> None:
        """Creates the agreed run directory (rank 0) once the run is built; every rank waits for it."""
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.opened = True
        self.barrier()

    def close(self, clean: bool = True) -> None:
        """Leaves the process group. After a clean run, ranks first meet, so that no rank
        tears its connections down while a peer still uses them (gloo can abort then)."""
        if self.distributed and dist.is_initialized():
            if clean:
                try:
                    dist.barrier()
                except Exception:
                    pass
            dist.destroy_process_group()
        if self.lock is not None:  # last: no rank of this job writes into the directory any more
            self.lock.release(remove_dirs=not self.opened)
            self.lock = None


def pick_device(requested: str) -> torch.device:
    """``requested`` is auto, cpu or cuda (conf/schema.py's Device); one GPU per local rank.

    With ``auto`` and more ranks on this machine than GPUs (the README's two-process command
    on a one-GPU machine), every rank trains on the CPU, and rank 0 says how to use the GPUs:
    the decision depends only on the machine, so all ranks of a node make the same one.
    """
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but this machine has no usable CUDA GPU: set device=auto or device=cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_ranks > gpus:
        if requested == "cuda":
            raise ConfigError(f"device=cuda with {local_ranks} ranks on this machine but {gpus} GPU(s): one GPU "
                              f"per rank, so set torchrun --nproc_per_node={gpus} (or device=auto to use the CPU)")
        print_once(f"WARNING: {local_ranks} ranks on this machine but {gpus} GPU(s): training on the CPU. "
                   f"Use torchrun --nproc_per_node={gpus} to train on the GPU(s).", file=sys.stderr)
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def start(device: torch.device, output_root: str, run_dir: Optional[str], run_name: str,
          collective_timeout_s: float = 600.0, take_over_run_dir: bool = False, needs_group: bool = False,
          init_meta: bool = False) -> Runtime:
    """Joins the process group (when launched by torchrun; ``needs_group``: a group of one without it,
    for FSDP2, whose shards live on a device mesh) and agrees on one run directory, which rank 0 claims
    for the whole job (trainer/run/run_lock.py) before anything is written there. ``init_meta``: recipes
    build their models on the meta device (``Runtime.init_device``)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = env_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    launched = "RANK" in os.environ and "MASTER_ADDR" in os.environ
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any other CUDA work on this rank
    if launched or needs_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        store = _attempt_store(rank, world_size, timeout) if launched else dist.HashStore()
        dist.init_process_group(
            backend=backend, timeout=timeout, store=store,
            rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None,
        )
    rt = Runtime(rank, local_rank, world_size, device, launched or needs_group, Path("."),
                 init_device=torch.device("meta") if init_meta else torch.device("cpu"))
    try:
        decided = None
        if rank == 0:
            chosen = _choose_run_dir(output_root, run_dir, run_name)
            problem, error = _why_not_writable(Path(chosen)), ConfigError
            if problem is None:
                try:
                    rt.lock = acquire(Path(chosen), take_over=take_over_run_dir)
                except RunDirInUse as e:
                    problem, error = str(e), RunDirInUse
                except OSError as e:
                    problem = (f"cannot claim the run directory {chosen!r} ({e.strerror}: {e.filename!r}): "
                               "set output_root=... or run_dir=... to a writable place")
            decided = (chosen, problem, error.__name__)
        chosen, problem, error = rt.broadcast_object(decided)
        if problem:  # every rank stops with rank 0's reason, none waits for it
            raise (RunDirInUse if error == RunDirInUse.__name__ else ConfigError)(problem)
        rt.run_dir = Path(chosen)
    except BaseException:
        rt.close(clean=False)
        raise
    return rt


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with this attempt's keys kept apart from earlier attempts'.

    After a restart (``torchrun --max-restarts``) the agent's store still holds the keys
    the failed attempt's process group wrote; a new rank can read a dead peer's address
    from them and fail to connect. A prefix per restart count avoids that.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts_store and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def _choose_run_dir(output_root: str, run_dir: Optional[str], run_name: str) -> str:
    """``run_dir`` if set; else ``<output_root>/<date>/<time>_<run_name>``, and under torchrun
    ``<output_root>/<date>/<time>_<run_name>_<rendezvous id>``. torchrun keeps the id across restarts
    of one job (``--max-restarts``, the same command with the same ``--rdzv-id``); a restart cannot
    know the first start's time, so it finds the job's directory by its id and resumes there."""
    if run_dir:
        return run_dir
    job_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if job_id not in ("", "none"):
        run_name = f"{run_name}_{job_id}"
        earlier = _dated_dirs(Path(output_root), run_name)
        if earlier:
            return str(earlier[-1])
    now = datetime.datetime.now()
    return str(Path(output_root) / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S')}_{run_name}")


def _dated_dirs(output_root: Path, name: str) -> List[Path]:
    """The directories ``<output_root>/<date>/<time>_<name>``, oldest first."""
    shape = re.compile(r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}_" + re.escape(name))
    return sorted(p for p in output_root.glob(f"*/*_{glob.escape(name)}")
                  if p.is_dir() and shape.fullmatch(p.relative_to(output_root).as_posix()))


def _why_not_writable(path: Path) -> Optional[str]:
    """Why ``path`` could not be created and written, or None; creates nothing.

    The run directory is made when rank 0 claims it (trainer/run/run_lock.py); if the run ends
    before it opens the directory (``Runtime.make_run_dir``: a config error found while
    building), the claim removes what it made, so that no empty directory stays behind.
    """
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        why = "Not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = "Permission denied"
    else:
        return None
    return (f"cannot write to the run directory {str(path)!r} ({why}: {str(existing)!r}): "
            "set output_root=... or run_dir=... to a writable place")


def seed_everything(seed: int, deterministic: bool) -> None:
    """Same seed on every rank: every rank builds the same initial model."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s step randomness (dropout, augmentation): different on every rank."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % 2**63


def seed_rank_streams(seed: int, rank: int) -> None:
    """Reseeds the generators the step draws from, per rank, once the model is built.

    Model initialisation used the shared seed (identical replicas, as DDP needs); from
    here on each rank draws its own dropout masks, crops and flips, so the global batch
    is as varied as one large batch would be.
    """
    s = rank_seed(seed, rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
