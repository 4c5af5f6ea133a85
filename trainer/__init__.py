"""The training machinery: the loop, the step, data loaders, optimizers and schedules,
checkpoints, the runtime (process group, devices, seeds), metrics logging, and the
Recipe contract (trainer/recipe.py) that a recipe fulfils.

The trainer finds recipes, optimizers and schedules through config (``_target_``), never
through a list of its own; how a step executes is graphing's business.
"""
