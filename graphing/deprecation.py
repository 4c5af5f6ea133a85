"""Renamed public names keep working for a while: each old name warns once, naming the new one
(graphing is installed by other projects; CHANGELOG.md lists every change to its public names)."""
from __future__ import annotations

import warnings

_warned: set = set()


def warn_renamed_once(old: str, new: str) -> None:
    """A DeprecationWarning, once per process and name, pointing at the caller's line."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"{old} is deprecated: use {new}. The old name will be removed in a later release "
                  "(see graphing's CHANGELOG.md)", DeprecationWarning, stacklevel=3)
