"""The training machinery, in rooms by concern:

    session.py     every job's frame (plan, join, teardown, errors -> exit codes) and the training job
    trainer.py     the Trainer: builds a run from the plan and runs its loop (fit)
    plan.py        every check and choice, once, before the ranks meet; the recipe built and checked
    recipe.py      the Recipe contract a recipe fulfils; policies.py: when the loop logs, checkpoints, evaluates
    step/          the step: its order, the optimizer and LR schedules, sequence lengths, activation checkpointing
    parallel/      how the model is parallel: DDP's or FSDP2's settings, sharding, the optimizer on shards, float8
    data/          loaders with static shapes, dataset items, reading workers, real or synthetic data
    checkpoint/    checkpoint formats, resume, retention
    metrics/       metrics.jsonl and W&B, step times and throughput, results, the progress bar
    run/           the run's life in its process: torchrun, process group, run directory, signals, storage, logs

The trainer finds recipes, optimizers and schedules through config (``_target_``), never through a
list of its own; how a step executes is graphing's business. The modules that moved into these
rooms still import by their old names (``trainer.errors``, ``trainer.schedules.Cosine`` in a
config), with a FutureWarning naming the new one (CHANGELOG.md); no import here is heavier than
the standard library's, as train.py imports this package before torch and Hydra.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_MOVED = {  # old module -> new module (see CHANGELOG.md)
    **{f"trainer.{name}": f"trainer.run.{name}" for name in
       ("process", "runtime", "run_lock", "stop", "storage", "log_files", "errors", "cli", "hooks", "targets")},
    "trainer.process_clock": "trainer.run.process", "trainer.exit_codes": "trainer.run.errors",
    "trainer.sources": "trainer.data.sources", "trainer.metrics_logger": "trainer.metrics.logger",
    **{f"trainer.{name}": f"trainer.metrics.{name}" for name in
       ("wandb_sidecar", "perf", "results", "progress", "sweep_report")},
    **{f"trainer.{name}": f"trainer.parallel.{name}" for name in ("parallelism", "sharding", "shard_optimizer")},
    **{f"trainer.{name}": f"trainer.step.{name}" for name in
       ("optim", "schedules", "seq_len", "activation_checkpointing")},
    "trainer.training": "trainer.session",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module it became: the same module object, so that classes
    (and what a checkpoint pickled) are the same classes under either name."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        new = _MOVED[spec.name]
        warnings.warn(f"{spec.name} is now {new}: import it (or name it in a config's _target_) by its new name; "
                      "the old one goes in a later release", FutureWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._real_spec = module.__spec__  # importlib sets the alias's spec on it: put the real one back
        return module

    def exec_module(self, module):
        module.__spec__ = self._real_spec


sys.meta_path.append(_MovedModules())
