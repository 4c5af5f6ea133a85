"""A checkpoint that cannot be loaded, and why, in one line.

``torch.load``'s errors end in advice to retry with ``weights_only=False``, i.e. to run the pickled
code of a damaged or foreign file: ``UnreadableCheckpoint`` carries a one-line cause without it.
"""
from __future__ import annotations

import re
from pathlib import Path


class UnreadableCheckpoint(Exception):
    """``path`` is not a loadable checkpoint; ``cause`` says why in one line (never torch's advice)."""

    def __init__(self, path: Path, cause: str):
        super().__init__(f"{path}: {cause}")
        self.path, self.cause = path, cause


def short_cause(e: BaseException) -> str:
    """``Type: first sentence`` of an exception from ``torch.load``/``zipfile``, at most one line.

    torch's messages go on with advice to retry with ``weights_only=False``, which would run
    whatever code the (damaged or foreign) file pickled; that advice is dropped here.
    """
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)  # strerror: the path is named elsewhere
    marker = "WeightsUnpickler error:"  # torch: "Weights only load failed. <advice> ... WeightsUnpickler error: <why>"
    if marker in text:
        text = text.split(marker, 1)[1]
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z(])|\n", text.strip(), maxsplit=1)[0].strip().rstrip(".")
    if not first or "weights_only" in first:
        return type(e).__name__
    return f"{type(e).__name__}: {first[:200]}"
