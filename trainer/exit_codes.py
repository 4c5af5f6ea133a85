"""Every exit code of train.py and of the scripts that take its config, one meaning each.

Listed for users in docs/checkpoints.md ("Exit codes"). The doctor's verdicts (scripts/doctor.py) are
graphing's own (graphing/doctor/report.py, 6 and 7), chosen apart from these: tests/test_bad_input.py
checks that no two codes share a value. (No import here: train.py reads this before torch is loaded.)
"""
from __future__ import annotations

EXIT_DONE = 0
EXIT_CRASH = 1  # an unexpected error (its traceback in rank<N>.log), or a peer rank died
EXIT_CONFIG = 2  # a setting that cannot work, or a config that does not compose: the message names it
EXIT_CAPTURE = 3  # a CUDA graph capture failed under graph.on_failure=fail (the default; =eager goes on eagerly)
EXIT_NONFINITE = 4  # the training loss became NaN/Inf
EXIT_STORAGE = 5  # a checkpoint, results or metrics write failed (no space, quota, read-only)
EXIT_INTERRUPTED = 130  # SIGINT (128 + 2)
EXIT_PREEMPTED = 143  # SIGTERM (128 + 15), after a checkpoint

TRAINER_EXIT_CODES = {"done": EXIT_DONE, "crash": EXIT_CRASH, "config": EXIT_CONFIG, "capture": EXIT_CAPTURE,
                      "nonfinite": EXIT_NONFINITE, "storage": EXIT_STORAGE, "interrupted": EXIT_INTERRUPTED,
                      "preempted": EXIT_PREEMPTED}
