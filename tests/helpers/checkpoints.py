"""The tests' own oracle for a checkpoint file, independent of trainer.checkpoint."""
from __future__ import annotations


def torch_loads(path) -> bool:
    """Does torch load it (weights only)?"""
    import torch
    try:
        torch.load(path, weights_only=True)
        return True
    except Exception:
        return False
