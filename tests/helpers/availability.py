"""What this machine has, for a test's skip: CUDA devices, optional extras."""
from __future__ import annotations

import pytest


def cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# Optional extras: the module a test needs -> the requirements file that installs it. The README's set-up installs
# requirements.txt alone, so a test that needs one of these skips without it, saying how to get it.
EXTRAS = {"transformers": "requirements-hf.txt", "torchao": "requirements-float8.txt",
          "simplejpeg": "requirements-images.txt"}


def needs_extra(module: str):
    """The optional ``module`` (imported), or a skip that names it and the command that installs it. Tests that
    call this carry ``pytest.mark.extras``: CI installs every extra after the README's pytest, then runs
    ``pytest -m extras``."""
    return pytest.importorskip(module, reason=f"needs the optional {module}: pip install -r {EXTRAS[module]}")
