"""Real data or the synthetic stand-in: one decision, made by rank 0, followed by every rank."""
from __future__ import annotations

import logging
import socket
from typing import Callable, Optional, Tuple

from trainer.run.errors import ConfigError
from trainer.recipe import Datasets, Split
from trainer.run.runtime import Runtime


def resolve_source(rt: Runtime, requested: str, real_name: str, data_key: str,
                   load_real: Callable[[bool], Tuple[Split, Split]],
                   make_synthetic: Callable[[], Tuple[Split, Split]],
                   handled_before: Tuple[str, ...] = ()) -> Datasets:
    """Loads ``real_name`` or the synthetic stand-in, as ``requested`` says.

    auto: the real set when present under data.root or downloadable, otherwise the
    synthetic one with a loud warning. Rank 0 decides (and downloads); every rank
    then loads what rank 0 decided, so all ranks train on the same data.
    ``handled_before``: the sources the recipe takes care of before calling this one
    (the image recipes' ``folder``), listed in the message for a source that is not known.
    """
    allowed = ("auto", real_name, "synthetic")
    if requested not in allowed:
        raise ConfigError(f"{data_key}.source={requested!r} is not one of {', '.join(allowed + handled_before)}: "
                          f"set {data_key}.source=auto")
    decision = None
    if rt.is_main:
        decision = ("synthetic", None)
        if requested != "synthetic":
            why = _try_real(load_real)
            if why is None:
                decision = (real_name, None)
            elif requested == real_name:
                decision = (None, f"{data_key}.source={real_name} but {real_name} is not under "
                                  f"{data_key}.root and could not be downloaded ({why}): put the files "
                                  f"there, set {data_key}.root=..., or set {data_key}.source=synthetic")
            else:
                logging.getLogger(__name__).warning(
                    f"WARNING: {real_name} is not available ({why}); training on SYNTHETIC data instead. "
                    f"Set {data_key}.root=... to use the real files.")
    source, problem = rt.broadcast_object(decision)
    if problem:
        raise ConfigError(problem)
    train, test = load_real(False) if source == real_name else make_synthetic()
    return Datasets(train, test, source)


def _try_real(load_real: Callable[[bool], Tuple[Split, Split]]) -> Optional[str]:
    try:
        load_real(False)
        return None
    except Exception:
        pass
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(15)  # an offline machine must not hang on the download
    try:
        load_real(True)
        return None
    except Exception as e:  # no network, no files: say which
        return " ".join(f"{type(e).__name__}: {e}".split())[:200]
    finally:
        socket.setdefaulttimeout(previous)

