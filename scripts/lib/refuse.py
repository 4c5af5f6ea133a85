"""A script's refusal: bad input, missing hardware or a missing optional package.

One message and train.py's exit code for a setting that cannot work (2, trainer/run/errors.py),
so that a caller can tell it from a crash or a failed child run (1).
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

from trainer.run.errors import EXIT_CONFIG


def refuse(message: str) -> NoReturn:
    """Prints ``message`` to stderr once (rank 0 under torchrun: every rank refuses alike) and exits 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG)
