"""What a checkpoint holds of a training run, saving it, and putting it back.

A checkpoint holds the model, the optimizer, fp16's loss scaler (scale and growth tracker), the step
(so the position in the epoch), every rank's RNG states, the W&B run id, the recipe and the resolved
config. How it is laid out on disk is the format's business, chosen once here from the run's
parallelism (trainer/checkpoint/choice.py): every rank takes its part (``CheckpointFormat.stage``: nothing for
one file, its own shards for DCP), then rank 0 writes the rest and publishes it, and retention keeps
the newest ``checkpoint.keep``.

A storage failure stops every rank alike (trainer/run/storage.py's policy): rank 0's outcome reaches
every rank in the broadcast that ends the write, a check every rank makes is gathered, and each
says the last good checkpoint and what to do. Restored on every rank before warm-up and capture, in
place, so that DDP and any captured graph keep reading the same tensors.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from trainer.checkpoint.choice import format_for, format_of
from trainer.checkpoint.compatibility import check_compatible, check_same_epochs
from trainer.checkpoint.find import latest_checkpoint, load_checkpoint
from trainer.checkpoint.one_file import save_best
from trainer.checkpoint.restore import load_model_state, load_optimizer_state
from trainer.checkpoint.retention import add_checkpoint
from trainer.checkpoint.rng import rng_state, set_rng_state
from trainer.checkpoint.unreadable import UnreadableCheckpoint
from trainer.run.errors import ConfigError, StorageError
from trainer.parallel.parallelism import Parallelism
from trainer.run.runtime import Runtime, print_once, seed_rank_streams

log = logging.getLogger(__name__)


class TrainingState:
    def __init__(self, rt: Runtime, *, model: torch.nn.Module, parallelism: Parallelism,
                 optimizer: torch.optim.Optimizer, step_counter: torch.Tensor, recipe_name: str, config: Dict[str, Any],
                 seed: int, keep: int, scaler: Optional["torch.amp.GradScaler"] = None, steps_per_epoch: int = 0):
        self.rt, self.model, self.optimizer, self.step_counter = rt, model, optimizer, step_counter
        self.format = format_for(parallelism)  # what this run writes, chosen once
        self.steps_per_epoch = steps_per_epoch  # saved: a resume with epochs of another length is refused
        self.scaler = scaler
        self.recipe_name, self.config, self.seed, self.keep = recipe_name, config, seed, keep
        self.last_saved: Optional[Path] = None  # the newest checkpoint this run wrote (rank 0 knows the path)
        self.last_good: Optional[Path] = None  # the newest checkpoint on disk known good: resumed from, or written
        self.best: Optional[Dict[str, Any]] = None  # {"metric", "value", "step"} of best.pt, carried across resumes

    @property
    def is_main(self) -> bool:
        return self.rt.is_main

    def _all_rng_states(self):
        """Every rank's RNG states, in rank order (each rank draws its own dropout and augmentation)."""
        mine = rng_state()
        if not self.rt.distributed:
            return [mine]
        states = [None] * self.rt.world_size
        dist.all_gather_object(states, mine)
        return states

    def save(self, step: int, epoch: int, wandb_run_id: Optional[str],
             before: Optional[Callable[[], None]] = None) -> None:
        """Every rank takes its part (RNG states; a sharded model's shards), then rank 0 writes the rest of the
        training state and publishes the checkpoint, and every rank learns the outcome.

        ``before``: rank 0's other writes due first (metrics rows that could not be appended).
        A storage failure on rank 0 reaches every rank in the broadcast that ends the save, and
        every rank raises the same StorageError: the run stops together (trainer/run/storage.py).
        """
        rng = self._all_rng_states()
        extra = {"step": step, "epoch": epoch, "steps_per_epoch": self.steps_per_epoch, "rng": rng,
                 "world_size": self.rt.world_size, "wandb_run_id": wandb_run_id, "recipe": self.recipe_name,
                 "config": self.config, "best": self.best}
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()  # scale and growth tracker: the next steps depend on them
        run_dir = self.rt.run_dir
        staged = self.format.stage(self, run_dir, step, self.model, self.optimizer)

        def write() -> None:
            if before is not None:
                before()
            self.last_saved = self.last_good = add_checkpoint(
                run_dir, self.keep, lambda: self.format.write(run_dir, step, staged, extra))

        self.on_rank0(write)

    def on_rank0(self, write: Callable[[], None]) -> None:
        """Rank 0 writes; then every rank learns the outcome (the broadcast ends the write): a storage
        failure raises the same StorageError, with the last good checkpoint and what to do, on every rank."""
        failed = None
        if self.rt.is_main:
            try:
                write()
            except StorageError as e:
                failed = self.storage_advice(str(e))
        self.agree_on_storage(failed)

    def on_every_rank(self, check: Callable[[], None]) -> None:
        """Every rank runs ``check``; a storage failure on any rank raises on every rank, each holding every
        rank's answer, with the first failing rank's message: all raise alike, none waits in a collective."""
        problem = None
        try:
            check()
        except StorageError as e:
            problem = self.storage_advice(str(e))
        problems = [problem]
        if self.rt.distributed:
            problems = [None] * self.rt.world_size
            dist.all_gather_object(problems, problem)
        failed = next((p for p in problems if p), None)
        if failed:
            raise StorageError(failed)

    def storage_advice(self, said: str) -> str:
        """A storage failure's message, completed with the last good checkpoint and what to do."""
        if self.last_good is None:
            lost = "no checkpoint of this run is on disk yet, so the same command will start over"
        else:
            lost = f"the last good checkpoint is {self.last_good}; the same command resumes from it"
        return (f"{said}. Nothing was left half-written; {lost}. Free space there (fewer checkpoints: lower "
                f"checkpoint.keep) or fix the directory's rights, then run the same command with "
                f"run_dir={self.rt.run_dir}")

    def agree_on_storage(self, failed: Optional[str]) -> None:
        """Rank 0's write outcome on every rank (this is the collective that ends the write): all raise or none."""
        failed = self.rt.broadcast_object(failed)
        if failed:
            raise StorageError(failed)

    def resume(self, checkpoint_cfg) -> Tuple[int, Optional[str]]:
        """Puts back what ``checkpoint.resume`` finds (else ``checkpoint.init_from``'s weights), before any
        warm-up or capture: graphs must see the restored tensors. Returns (step to start at, W&B run id)."""
        restored = self.restore(checkpoint_cfg.resume)
        if restored is None and checkpoint_cfg.init_from is not None:  # a resume of this run wins
            self.init_weights(checkpoint_cfg.init_from)
        if restored is None:
            return 0, None
        return int(restored["step"]), restored.get("wandb_run_id")

    def restore(self, resume: str) -> Optional[Dict[str, Any]]:
        """Loads the checkpoint ``resume`` names (auto: the newest readable one); returns it, or None."""
        if resume == "never":
            return None
        if resume == "auto":
            found = latest_checkpoint(self.rt.run_dir)
            if found is None:
                return None
            path, state = found
        else:
            path = Path(resume)
            state = _load_named(path, resume)
        check_compatible(state, self.recipe_name, resume=resume, path=path)
        check_same_epochs(state, self.config, self.steps_per_epoch, resume=resume, path=path)
        read_in = format_of(path)  # either kind, whatever this run writes; in place: DDP and graphs see it
        load_model_state(self.model, state, self.config, read_in=read_in, live=self.format, resume=resume, path=path)
        load_optimizer_state(self.optimizer, state["optimizer"], model=self.model, read_in=read_in, live=self.format)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])  # in place where the scale exists already
        self.step_counter.fill_(state["step"])
        self._restore_rng(state)
        self.best = state.get("best")
        self.last_good = path
        print_once(f"resumed from {path} at step {state['step']}")
        return state

    def _restore_rng(self, state: Dict[str, Any]) -> None:
        saved = state["rng"]
        if isinstance(saved, dict):  # written by one process per checkpoint (before per-rank streams)
            saved = [saved]
        if len(saved) == self.rt.world_size:
            set_rng_state(saved[self.rt.rank])
            return
        # Another world size: no rank's stream continues exactly; reseed from the step, the same way every time.
        if self.rt.is_main:
            log.warning("the checkpoint was written by %d ranks, this run has %d: random streams are reseeded "
                        "(training continues, but not bit for bit as it would have)", len(saved), self.rt.world_size)
        seed_rank_streams(self.seed + int(state["step"]), self.rt.rank)

    def init_weights(self, path: str) -> None:
        """Starts from the model weights of ``path`` (any run's checkpoint or best.pt); optimizer and step fresh."""
        try:
            saved = load_checkpoint(Path(path))["model"]
            format_of(Path(path)).load_model(self.model, saved, self.format)  # in place, like a resume
        except (UnreadableCheckpoint, KeyError, RuntimeError) as e:
            cause = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise ConfigError(f"checkpoint.init_from={path} cannot start this model ({cause}): point it at a "
                              "checkpoint of the same model, or drop it") from None
        print_once(f"initialised from the weights of {path} (fresh optimizer, schedule and step)")

    def maybe_save_best(self, step: int, metrics: Dict[str, float], metric: str) -> bool:
        """Writes best.pt when ``metrics[metric]`` beats the best so far (lower for a loss, higher otherwise)."""
        value = metrics.get(metric)
        if value is None:
            raise ConfigError(f"checkpoint.best_metric={metric} is not among the evaluation's metrics "
                              f"({', '.join(sorted(metrics))}): choose one of them")
        lower_is_better = "loss" in metric
        if self.best is not None and (value >= self.best["value"] if lower_is_better else value <= self.best["value"]):
            return False
        self.best = {"metric": metric, "value": value, "step": step}
        model_state = self.format.whole_model_state(self.model)  # every rank: a sharded model's shards are gathered
        self.on_rank0(lambda: save_best(self.rt.run_dir, {"model": model_state, "step": step,
                                                           "best": self.best, "recipe": self.recipe_name,
                                                           "config": self.config}))
        return True


def _load_named(path: Path, resume: str) -> Dict[str, Any]:
    """The checkpoint ``checkpoint.resume=<path>`` names (trainer/plan.py checked that it exists).

    An unreadable file is a ConfigError that names it once: unlike ``auto``, a named file
    is not skipped for an older one behind the user's back.
    """
    try:
        return load_checkpoint(path)
    except UnreadableCheckpoint as e:  # its cause is one line, without torch's advice to load with weights_only=False
        raise ConfigError(f"checkpoint.resume={resume} cannot be read (truncated or not a checkpoint: {e.cause}): "
                          "point checkpoint.resume at another checkpoint, or set checkpoint.resume=auto / never"
                          ) from None
