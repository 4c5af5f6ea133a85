"""The same weights digested whole and sharded with FSDP2, on each rank: what tests/test_digest.py compares
across world sizes.

    torchrun --nproc_per_node=2 tests/helpers/digest_ranks.py OUT_DIR     # writes OUT_DIR/rank<R>_of<W>.json

Every rank builds the same small model (rows that do not split evenly over 2 ranks, and a parameter of one
row, whose shard on the second rank is empty), digests it as it is (each rank its own replica, as under
DDP), then shards it with ``fully_shard`` and digests the shards (a collective).
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from graphing import weights_digest  # noqa: E402


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1), torch.nn.Embedding(7, 2))


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    whole = model()
    result = {"whole": weights_digest(whole)}
    with torch.no_grad():  # one element one ulp further: another digest
        changed = model()
        changed[2].weight[6, 1] = torch.nextafter(changed[2].weight[6, 1], torch.tensor(1.0))
    result["one_element_changed"] = weights_digest(changed)
    swapped = model()
    result["parameters_reordered"] = weights_digest(swapped, [*swapped.parameters()][::-1])
    sharded = model()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
    result["shards"] = [tuple(p.to_local().shape) for p in sharded.parameters()]
    result["sharded"] = weights_digest(sharded)
    (out / f"rank{rank}_of{world}.json").write_text(json.dumps(result))
    del sharded
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
