"""Ranks that start, join a gloo group and then hang: what tests/test_launch_cleanup.py stops.

    torchrun --nproc_per_node=2 tests/helpers/hanging_ranks.py OUT_DIR [--ignore-sigterm]

Once every rank is in the group, each writes OUT_DIR/rank<R>.pid (its pid, then the run marker it
inherited, scripts/lib/process_tree.py) and sleeps for good. ``--ignore-sigterm``: the ranks ignore
SIGTERM, as a rank stuck in a collective does not answer it, so only a SIGKILL ends them.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.lib.process_tree import MARK  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    if "--ignore-sigterm" in sys.argv[2:]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    partial = out / f".rank{rank}.pid"
    partial.write_text(f"{os.getpid()}\n{os.environ.get(MARK, '')}\n")
    partial.rename(out / f"rank{rank}.pid")  # whole or absent, for a reader polling for it
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
