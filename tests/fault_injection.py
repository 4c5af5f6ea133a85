"""Test-only entry point: train.py with a fault injected through the loop's after-step hook.

    GRAPHED_DDP_TEST_KILL_AT_STEP=25:1 torchrun ... tests/fault_injection.py <train.py overrides>

"STEP" or "STEP:RANK" (rank 1 by default) kills that rank hard right after that step, on
a job's first attempt only (the restart tests). Every rank that torchrun starts runs this
file, so the hook reaches every rank; train.py itself never reads the variable.
"""
import os
import runpy
import sys
from pathlib import Path

KILL_AT_STEP_ENV = "GRAPHED_DDP_TEST_KILL_AT_STEP"
ROOT = Path(__file__).resolve().parents[1]


def kill_at(spec: str):
    at, _, victim = spec.partition(":")

    def hook(step: int, rank: int) -> None:
        if step == int(at) and rank == int(victim or 1):
            print(f"[rank {rank}] {KILL_AT_STEP_ENV}={spec}: killing this rank at step {step}", flush=True)
            os._exit(13)

    return hook


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    spec = os.environ.get(KILL_AT_STEP_ENV)
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        from trainer import hooks  # import-free: train.py still takes the signals before any thread starts

        hooks.after_step.append(kill_at(spec))
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
