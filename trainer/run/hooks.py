"""Extension points of the training loop, free of imports so that an entry script can fill
them before train.py starts (and before any thread does: see trainer/run/stop.py).

``after_step``: callables ``hook(step, rank)`` run on the host after every training step, once the
step's metrics, checkpoint and stop decision are done: the loop's one hook after a step. Empty in
production; the tests inject faults through it (tests/helpers/fault_injection.py). Device work inside
the step itself (captured with it) is not a hook of the loop: it is the step's own
(``StepSettings.first_in_step``/``last_in_step``, trainer/step/steps.py).
"""
from typing import Callable, List

after_step: List[Callable[[int, int], None]] = []
