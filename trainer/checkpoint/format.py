"""The one protocol both checkpoint formats follow, so that nothing else asks which one it has.

A run writes one format, chosen once (trainer/checkpoint/choice.py): a plain model's checkpoint (DDP
or one process) is one file that rank 0 writes (trainer/checkpoint/one_file.py), a sharded model's
(train.parallel=fsdp2) a directory into which every rank writes its own shards
(trainer/checkpoint/dcp_shards.py). A run reads either kind, whatever it writes: the path tells the
format (``choice.format_of``), and both kinds are listed, kept and skipped when damaged as one series
(trainer/checkpoint/find.py, retention.py).

Writing has two phases because a sharded checkpoint needs every rank: ``stage`` runs on every rank
(nothing for one file; each rank's shards for DCP), then ``write`` on rank 0 (the file; DCP's training
state and the rename that publishes the shards). Either leaves a complete checkpoint under its final
name or nothing under it (trainer/checkpoint/layout.py's temp names).

Reading mirrors writing: the format of the path (``choice.format_of``) reads the training state
(``read``), then puts its model and optimizer entries into the live ones in place (``load_model``,
``load_optimizer``), whatever the live model is. Whole tensors (a one-file checkpoint's) go in as the
live model's own format puts them (``load_whole_model``, ``load_whole_optimizer``): into a sharded
model's shards too. So the caller names both formats, the one read and the one its run writes, and
nobody asks which kind a saved entry is. best.pt is one file of whole weights in either format
(``whole_model_state``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

from trainer.checkpoint.layout import checkpoint_dir, step_of


class Ranks(Protocol):
    """What ``stage`` needs of the ranks it runs on (TrainingState provides it, trainer/checkpoint/state.py)."""

    is_main: bool

    def on_every_rank(self, check: Callable[[], None]) -> None:
        """Runs ``check`` on every rank; a storage failure on any rank raises on every rank alike."""

    def storage_advice(self, said: str) -> str:
        """A storage failure's message, completed with the last good checkpoint and what to do."""


class CheckpointFormat(ABC):
    """How one kind of checkpoint is written, found, judged and read."""

    suffix: str  # of its name, after step_<N> (trainer/checkpoint/layout.py)
    is_dir: bool  # a directory (else a file)

    def holds(self, path) -> bool:
        """Whether ``path`` is of this format by its name and kind (it may still be damaged: ``damage``)."""
        path = Path(path)
        return path.suffix == self.suffix and (path.is_dir() if self.is_dir else path.is_file())

    def find(self, run_dir: Path) -> List[Tuple[int, Path]]:
        """This format's checkpoints of ``run_dir`` with their steps, unordered; a temp name is no step name."""
        folder = checkpoint_dir(run_dir)
        if not folder.is_dir():
            return []
        return [(step, p) for p in folder.iterdir() if (step := step_of(p)) is not None and self.holds(p)]

    @abstractmethod
    def stage(self, ranks: Ranks, run_dir: Path, step: int, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> Any:
        """Every rank's part of saving ``step`` (a collective where the format needs one); what it returns
        goes to ``write``. A storage failure raises the same StorageError on every rank."""

    @abstractmethod
    def write(self, run_dir: Path, step: int, staged: Any, extra: Dict[str, Any]) -> Path:
        """Rank 0: the checkpoint of ``step`` completed with ``extra`` (everything but the model's and
        optimizer's tensors) and published under its name, which it returns."""

    @abstractmethod
    def read(self, path: Path) -> Dict[str, Any]:
        """The training state at ``path`` on the CPU (weights_only); its ``model`` and ``optimizer`` entries are
        for ``load_model`` and ``load_optimizer``. Raises whatever a damaged one makes torch or the filesystem raise."""

    @abstractmethod
    def load_model(self, model: torch.nn.Module, saved: Any, live: CheckpointFormat) -> None:
        """``saved`` (the ``model`` entry of this format's ``read``) into ``model`` in place, on every rank.
        ``live``: the format ``model``'s own run writes, which knows how whole tensors go into it."""

    @abstractmethod
    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Any,
                       live: CheckpointFormat) -> None:
        """``saved`` (the ``optimizer`` entry of this format's ``read``) into ``optimizer``, whose model is
        ``model``, on every rank; ``live`` as for ``load_model``."""

    @abstractmethod
    def damage(self, path: Path) -> Optional[str]:
        """Why ``path`` is not a complete checkpoint, or None, cheaply (retention asks on every save):
        a file that passes may still fail to load. Raises OSError when it cannot be read at all."""

    @abstractmethod
    def whole_model_state(self, model: torch.nn.Module) -> Dict[str, Any]:
        """``model.state_dict()`` with whole tensors on rank 0 (every rank calls it: it may be a collective)."""

    @abstractmethod
    def load_whole_model(self, model: torch.nn.Module, state: Dict[str, Any]) -> None:
        """``model.load_state_dict(state)`` in place (every rank), whole tensors into this format's model."""

    @abstractmethod
    def load_whole_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             saved: Dict[str, Any]) -> None:
        """``optimizer.load_state_dict(saved)`` (torch's numbered form), into this format's model's optimizer."""
