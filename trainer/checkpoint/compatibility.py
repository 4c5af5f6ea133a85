"""Whether a checkpoint may resume this run: written by the same recipe, counting its steps over epochs
of the same length. Refused with a ConfigError naming the setting to change; the model's own settings
are compared when its tensors are put back (trainer/checkpoint/restore.py ``load_model_state``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from trainer.run.errors import ConfigError


def check_compatible(state: Dict[str, Any], recipe_name: str, *, resume: str = "auto",
                     path: Optional[Path] = None) -> None:
    """Raises ConfigError when ``state`` was not written by a run of ``recipe_name``."""
    saved = state.get("recipe")
    where = f" ({path})" if path is not None else ""
    if saved is None:
        raise ConfigError(f"checkpoint.resume={resume} found a checkpoint{where} with no recipe name: "
                          "set checkpoint.resume=never, or run_dir=... to a fresh directory")
    if saved != recipe_name:
        raise ConfigError(f"checkpoint.resume={resume} holds a checkpoint{where} of recipe {saved!r} "
                          f"but recipe={recipe_name}: set checkpoint.resume=never or use recipe={saved}")


def check_same_epochs(state: Dict[str, Any], config: Dict[str, Any], steps_per_epoch: int, *, resume: str = "auto",
                      path: Optional[Path] = None) -> None:
    """Raises ConfigError when ``state`` counts its steps over epochs of another length because
    ``recipe.data.drop_last`` differs: its step would resume at another sample of the epoch.
    A checkpoint from before the setting existed was written with the last partial batch dropped."""
    saved = (state.get("config") or {}).get("recipe", {}).get("data", {})
    saved_drop = bool(saved.get("drop_last", True))
    drop = (config.get("recipe") or {}).get("data", {}).get("drop_last")
    if drop is None:  # a state without this run's config (a test, a tool): nothing to compare
        return
    saved_steps = state.get("steps_per_epoch")
    if saved_drop == drop or saved_steps == steps_per_epoch:
        return
    if saved_steps is None and drop:  # an old checkpoint (dropped) resumed dropping: the same epochs
        return
    where = f" ({path})" if path is not None else ""
    had = f" ({saved_steps} steps per epoch)" if saved_steps is not None else ""
    raise ConfigError(
        f"checkpoint.resume={resume} found a checkpoint{where} written with recipe.data.drop_last="
        f"{str(saved_drop).lower()}{had}, but this run has drop_last={str(drop).lower()} ({steps_per_epoch} steps per "
        f"epoch): its step {state.get('step')} would resume at another sample of the epoch. Set recipe.data.drop_last="
        f"{str(saved_drop).lower()} to resume it, or checkpoint.resume=never to start over")
