"""The training step and what it is made of: the step's order (steps: TrainStep, EvalStep), the
optimizer and its LR schedule (optim, schedules: ``recipe.schedule._target_`` names one of these),
sequence-length buckets (seq_len) and activation checkpointing.
"""
