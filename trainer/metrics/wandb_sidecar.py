"""The W&B side of metrics logging, as a process of its own (run by trainer/metrics/logger.py).

Importing wandb and starting a run takes seconds of Python work; on a thread of the
training process that work holds the GIL and slows every step it overlaps (MNIST on one
H200: 0.29-0.32 ms per step instead of 0.248). Here it runs beside training instead, on
another core. The trainer sends pickled calls down this process's stdin:

    ("start", init_kwargs)   ("log", row)   ("summary", values)
    ("table", key, columns, rows, bar)      ("finish", exit_code)

A failure is reported once on stderr and the rest is ignored: W&B never stops training.
If stdin closes without a "finish" (the trainer died), the run is finished as failed.
Stop signals are ignored: the trainer decides when the run ends, so Ctrl-C in a terminal
(which reaches the whole process group) cannot cut the run's files short.

Standalone on purpose: it imports only the standard library and wandb, not torch.
"""
from __future__ import annotations

import pickle
import signal
import sys
from typing import Any, Dict, List, Optional

FAILURE_HINT = "training continues, metrics go to metrics.jsonl. Set logger=none to skip W&B."
WHAT = {"summary": "write the summary", "table": "log a table"}  # the other calls say themselves


def report(what: str, err: BaseException) -> None:
    print(f"[logger] W&B could not {what} ({type(err).__name__}: {err}); {FAILURE_HINT}", file=sys.stderr, flush=True)


def start(init: Dict[str, Any]):
    import wandb

    settings = wandb.Settings(init_timeout=init.pop("init_timeout_s"), console="off", silent=True)
    run = wandb.init(**init, settings=settings)
    run.define_metric("step")
    for prefix in ("train/*", "eval/*", "perf/*", "eager/*", "graph/*"):
        run.define_metric(prefix, step_metric="step")
    return run


def log_table(run, key: str, columns: List[str], rows: List[List[Any]], bar: Optional[tuple]) -> None:
    import wandb

    table = wandb.Table(columns=columns, data=rows)
    payload = {key: table}
    if bar is not None:
        payload[f"{key}_chart"] = wandb.plot.bar(table, bar[0], bar[1], title=key)
    run.log(payload)


def serve(stream) -> int:
    run, failed = None, False
    while True:
        try:
            message = pickle.load(stream)
        except EOFError:
            message = ("finish", 1)  # the trainer went away without finishing: mark the run failed
        kind, args = message[0], message[1:]
        if not failed and (run is not None or kind == "start"):
            try:
                if kind == "start":
                    run = start(*args)
                elif kind == "log":
                    run.log(*args)
                elif kind == "summary":
                    run.summary.update(*args)
                elif kind == "table":
                    log_table(run, *args)
                elif kind == "finish":
                    run.finish(exit_code=args[0])
            except Exception as e:
                report(WHAT.get(kind, kind), e)
                failed = True
        if kind == "finish":
            return 0


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(serve(sys.stdin.buffer))
