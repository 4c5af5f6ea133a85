"""Extension points of the training loop, free of imports so that an entry script can fill
them before train.py starts (and before any thread does: see trainer/run/stop.py).

``after_step``: callables ``hook(step, rank)`` run after every training step, once the
step's metrics, checkpoint and stop decision are done. Empty in production; the tests
inject faults through it (tests/helpers/fault_injection.py).
"""
from typing import Callable, List

after_step: List[Callable[[int, int], None]] = []
