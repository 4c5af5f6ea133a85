"""The RNG states a checkpoint carries, so a resumed run draws the numbers it would have drawn.

RNG states are per process: ``rng_state`` captures only the calling process's (torch CPU, its
CUDA device, python, numpy); TrainingState gathers every rank's (trainer/checkpoint/state.py). numpy's
state is stored as plain tensors and numbers so that it loads with ``weights_only=True``.
"""
from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch


def rng_state() -> Dict[str, Any]:
    """This process's RNG states (torch CPU, current CUDA device, python, numpy), weights_only-loadable."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state(legacy=True)
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one GPU per process
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restores what ``rng_state`` captured. A CUDA state is skipped on a machine without CUDA."""
    torch.set_rng_state(state["torch"].cpu())
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
