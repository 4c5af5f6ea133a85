"""Test-only entry point: train.py with a fault injected through the loop's after-step hook.

    GRAPHED_DDP_TEST_KILL_AT_STEP=25:1 torchrun ... tests/helpers/fault_injection.py <train.py overrides>
    GRAPHED_DDP_TEST_QUOTA_AT_STEP=12 torchrun ... tests/helpers/fault_injection.py <train.py overrides>

- KILL_AT_STEP, "STEP" or "STEP:RANK" (rank 1 by default): kills that rank hard right after
  that step, on a job's first attempt only (the restart tests). A comma-separated list names
  one kill per attempt: "25:1,45:0" kills rank 1 at step 25 on the first attempt and rank 0
  at step 45 on the second (the restart), and nothing on the third.
- QUOTA_AT_STEP, "STEP": from right after that step, rank 0's ``torch.save`` fails the way it
  does on a disk quota or a disk filled by someone else: it writes part of the file, then
  raises torch's errno-less ``RuntimeError: [enforce fail at inline_container.cc...] ... file
  write failed``. The filesystem's free space is left as it is (quotas are invisible to
  ``statvfs``), so the trainer's own room check passes and the failure path is what runs.
  This patches ``torch.save`` of files (not of in-memory buffers) in rank 0's process, only here.

- HOLD_GIL_AT_STEP, "STEP:RANK": right after that step, on a job's first attempt only, that rank calls C's
  ``sleep`` through ``ctypes.PyDLL``, which keeps Python's lock for the whole call: a rank stuck in a C call
  that holds the GIL, which no thread of its own can end (its stall guard does: tests/test_stall.py).

- STOP_AT_STEP, "STEP:RANK": right after that step, on a job's first attempt only, that rank stops itself with
  SIGSTOP, before an evaluation or a save that follows the step: a peer lost where the others are not in a
  training step (tests/test_stall.py).

- GPU_HANG_AT_STEP, "STEP:RANK": right after that step, on a job's first attempt only, that rank queues a
  kernel that spins for about ten minutes on its stream: a GPU that stops answering, with the rank's Python free
  (its step watchdog sees no step event complete: tests/test_stall_gpu.py).

- STOP_CHECK_S, seconds: the ranks ask each other about a stop request (SIGTERM) about every that
  many seconds of training instead of 2 (``trainer.run.stop.StopAgreement``'s spacing), so that a short
  test run stops within a few steps of the signal; the agreement itself is the same code.

- REPORT_GATHERS, "1": each time a sharded tensor (a DTensor with a Shard placement, more than one
  element) is gathered whole (``DTensor.full_tensor``, or ``redistribute`` to no Shard placement), the
  rank prints "[rank R] gathered a sharded tensor whole: SHAPE" and where; the gather itself runs as
  usual. Tests assert that a sharded run without checkpoints prints none.

Every rank that torchrun starts runs this file, so the hooks reach every rank; train.py itself
never reads these variables.
"""
import os
import runpy
import sys
from pathlib import Path

KILL_AT_STEP_ENV = "GRAPHED_DDP_TEST_KILL_AT_STEP"
QUOTA_AT_STEP_ENV = "GRAPHED_DDP_TEST_QUOTA_AT_STEP"
STOP_CHECK_S_ENV = "GRAPHED_DDP_TEST_STOP_CHECK_S"
REPORT_GATHERS_ENV = "GRAPHED_DDP_TEST_REPORT_GATHERS"
HOLD_GIL_AT_STEP_ENV = "GRAPHED_DDP_TEST_HOLD_GIL_AT_STEP"
GPU_HANG_AT_STEP_ENV = "GRAPHED_DDP_TEST_GPU_HANG_AT_STEP"
STOP_AT_STEP_ENV = "GRAPHED_DDP_TEST_STOP_AT_STEP"
FAULT_ENVS = (KILL_AT_STEP_ENV, QUOTA_AT_STEP_ENV, STOP_CHECK_S_ENV, REPORT_GATHERS_ENV, HOLD_GIL_AT_STEP_ENV,
              GPU_HANG_AT_STEP_ENV, STOP_AT_STEP_ENV)
GATHER_REPORT = "gathered a sharded tensor whole"
ROOT = Path(__file__).resolve().parents[2]


def at_step(env: str, spec: str, says: str, act):
    """The after-step hook of a fault given as ``env``="STEP:RANK" (rank 1 by default): right after that step, that
    rank prints ``[rank R] ENV=SPEC: <says> STEP`` and calls ``act()``."""
    at, _, victim = spec.partition(":")

    def hook(step: int, rank: int) -> None:
        if step == int(at) and rank == int(victim or 1):
            print(f"[rank {rank}] {env}={spec}: {says} {step}", flush=True)
            act()

    return hook


def kill_at(spec: str):
    return at_step(KILL_AT_STEP_ENV, spec, "killing this rank at step", lambda: os._exit(13))


def hold_gil_at(spec: str):
    import ctypes

    return at_step(HOLD_GIL_AT_STEP_ENV, spec, "holding the GIL in C from step",
                   lambda: ctypes.PyDLL("libc.so.6").sleep(3600))


def stop_at(spec: str):
    import signal

    return at_step(STOP_AT_STEP_ENV, spec, "stopping this rank after step", lambda: os.kill(os.getpid(), signal.SIGSTOP))


def gpu_hang_at(spec: str):
    def spin() -> None:
        import torch

        torch.cuda._sleep(2 ** 40)  # about 10 minutes of clock cycles on this rank's stream

    return at_step(GPU_HANG_AT_STEP_ENV, spec, "the GPU spins from step", spin)


def quota_at(spec: str):
    def hook(step: int, rank: int) -> None:
        if step != int(spec) or rank != 0:
            return
        import io

        import torch

        real_save = torch.save

        def save_over_quota(obj, f, *args, **kwargs):
            if not hasattr(f, "fileno") or isinstance(f, io.BytesIO):  # in-memory (collectives pickle with it)
                return real_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: buffer.tell() // 2])  # part of the file reaches the disk
            f.flush()
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed")

        torch.save = save_over_quota

    return hook


def report_whole_gathers() -> None:
    """Wraps DTensor's whole-tensor gathers so that each one says so (REPORT_GATHERS)."""
    import traceback

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def sharded(tensor) -> bool:
        return tensor.numel() > 1 and any(p.is_shard() for p in tensor.placements)

    def say(tensor) -> None:
        caller = next((f for f in reversed(traceback.extract_stack()[:-2])
                       if "torch" not in f.filename and f.filename != __file__), None)
        where = f" from {caller.filename}:{caller.lineno}" if caller else ""
        print(f"[rank {dist.get_rank()}] {GATHER_REPORT}: {tuple(tensor.shape)}{where}", flush=True)

    real_full, real_redistribute = DTensor.full_tensor, DTensor.redistribute

    def full_tensor(self, *args, **kwargs):
        if sharded(self):
            say(self)
        return real_full(self, *args, **kwargs)

    def redistribute(self, device_mesh=None, placements=None, *args, **kwargs):
        if sharded(self) and placements is not None and not any(p.is_shard() for p in placements):
            say(self)
        return real_redistribute(self, device_mesh, placements, *args, **kwargs)

    DTensor.full_tensor, DTensor.redistribute = full_tensor, redistribute


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from trainer.run import hooks  # import-free: train.py still takes the signals before any thread starts

    kills = [k for k in os.environ.get(KILL_AT_STEP_ENV, "").split(",") if k]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < len(kills):
        hooks.after_step.append(kill_at(kills[attempt]))
    if os.environ.get(HOLD_GIL_AT_STEP_ENV) and attempt == 0:
        hooks.after_step.append(hold_gil_at(os.environ[HOLD_GIL_AT_STEP_ENV]))
    if os.environ.get(STOP_AT_STEP_ENV) and attempt == 0:
        hooks.after_step.append(stop_at(os.environ[STOP_AT_STEP_ENV]))
    if os.environ.get(GPU_HANG_AT_STEP_ENV) and attempt == 0:
        hooks.after_step.append(gpu_hang_at(os.environ[GPU_HANG_AT_STEP_ENV]))
    if os.environ.get(QUOTA_AT_STEP_ENV):
        hooks.after_step.append(quota_at(os.environ[QUOTA_AT_STEP_ENV]))
    if os.environ.get(STOP_CHECK_S_ENV):
        from trainer.run.stop import StopAgreement  # import-free of threads: the signals are taken in train.py

        StopAgreement.__init__.__defaults__ = (float(os.environ[STOP_CHECK_S_ENV]),)
    if os.environ.get(REPORT_GATHERS_ENV):
        report_whole_gathers()
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
