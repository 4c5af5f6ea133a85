"""A user's loop over a model from an installed package whose forward reads a device value on the
host (``.item()``): what tests/test_doctor_library.py diagnoses in one process and under torchrun.

    python tests/helpers/library_sync_loop.py SITE_DIR REPORT_JSON                        # one process
    torchrun --nproc_per_node=2 tests/helpers/library_sync_loop.py SITE_DIR REPORT_JSON   # 2 gloo ranks (DDP)
    torchrun --nproc_per_node=2 tests/helpers/library_sync_loop.py SITE_DIR REPORT_JSON PACKAGE ddp,fsdp2   # and FSDP2

``write_package(root)`` makes the packages (``syncing_model``, ``capture_aware_model``,
``quiet_model``) in ``root/site-packages``, a folder the doctor takes for installed packages, as
pip's would be; SITE_DIR is that folder.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # graphing, as scripts/ find it

# Three packages with the same model: one syncs in every forward, one skips its sync while a CUDA stream
# is capturing (as transformers skips its mask shortcuts), one makes no sync (it always clamps).
PACKAGES = {
    "syncing_model": "        if h.abs().max().item() > 1e4:  # the library's host sync: a guard against overflow\n",
    "capture_aware_model": "        if not capturing() and h.abs().max().item() > 1e4:  # the library's host sync\n",
    "quiet_model": "",
}
PACKAGE_SOURCE = '''import torch


def capturing():
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:  # no CUDA
        return False


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(self.body(x))
{guard}            h = h.clamp(max=1e4)
        return self.head(h)
'''


def write_package(root: Path) -> Path:
    """The packages in ``root/site-packages``; returns that folder."""
    site = Path(root) / "site-packages"
    for name, guard in PACKAGES.items():
        (site / name).mkdir(parents=True, exist_ok=True)
        source = PACKAGE_SOURCE.format(guard=guard) if guard else PACKAGE_SOURCE.replace("{guard}    ", "")
        (site / name / "__init__.py").write_text(source)
    return site


def package_sync_line() -> int:
    """The line of the packages' host sync (the same in both)."""
    return next(n for n, text in enumerate(PACKAGE_SOURCE.splitlines(), 1) if text.startswith("{guard}"))


def shard(model: torch.nn.Module, device: str = "cpu") -> None:
    """FSDP2 as a user applies it: the model's blocks, then the root, on a 1-D mesh of all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for block in (model.body, model.head):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build(site: Path, package: str = "syncing_model", device: str = "cpu", parallel: str = "ddp"):
    """(step_fn, model, optimizer, inputs): the user's step over the package's model; ``parallel="fsdp2"``
    shards the model (a process group must be up), else the doctor wraps it in DDP under one."""
    import importlib

    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    torch.manual_seed(0)
    model = importlib.import_module(package).Net().to(device)
    if parallel == "fsdp2":
        shard(model, device)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)

    def step(model, x, y):  # plain SGD by hand: torch.optim's first use imports torch._dynamo (seconds)
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)  # doctor: host_sync
        loss.backward()
        with torch.no_grad():
            torch._foreach_add_([p for p in model.parameters()], [p.grad for p in model.parameters()], alpha=-0.05)
        return loss.detach()

    return step, model, None, (x, y)


def diagnose_loop(site: Path, package: str = "syncing_model", device: str = "cpu", parallel: str = "ddp"):
    """The user's step diagnosed (under a process group: in DDP, or sharded with FSDP2, on every rank)."""
    import graphing

    step, model, optimizer, inputs = build(site, package, device, parallel)
    return graphing.diagnose(step, model, optimizer, inputs, timing_steps=0)


def main(site: str, out: str, package: str = "syncing_model", parallel: str = "ddp") -> None:
    """Writes to ``out`` {parallel: the report} for each of ``parallel`` (comma-separated: ddp, fsdp2), one
    process group for all of them."""
    import torch.distributed as dist

    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    try:
        reports = {way: diagnose_loop(Path(site), package, parallel=way).to_dict() for way in parallel.split(",")}
        if not dist.is_initialized() or dist.get_rank() == 0:
            Path(out).write_text(json.dumps(reports))
        if dist.is_initialized():
            # Release what holds the process group (DDP's reducer, FSDP2's mesh, in reference cycles) while it
            # is up, then meet: left to the interpreter's exit, their gloo threads outlive it and abort the
            # process ("terminate called without an active exception").
            gc.collect()
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
