"""Components named by config (``_target_``): import a dotted path, or say which key to fix."""
from __future__ import annotations

import importlib
from typing import Any

from trainer.run.errors import ConfigError


def import_target(path: Any, key: str, example: str) -> Any:
    """The object at dotted ``path`` (``package.module.name``); ``key`` names the setting in errors."""
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}={path!r} is not a dotted path (package.module.name): set {key}={example}")
    module_path, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ConfigError(f"{key}={path} cannot be imported ({type(e).__name__}: {e}): check the path, and that "
                          f"its package is on PYTHONPATH (e.g. {key}={example})") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(f"{key}={path}: module {module_path} has no {name!r} (e.g. {key}={example})") from None
