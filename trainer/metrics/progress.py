"""The console's progress bar over an epoch's steps (rank 0, train.progress=true, a TTY)."""
from __future__ import annotations

from typing import Dict

from trainer.policies import StepPoint


def progress_bar(show: bool, total: int, desc: str):
    if not show:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False, mininterval=0.5, disable=None)  # None: off without a TTY


def show_on_bar(bar, at: StepPoint, metrics: Dict[str, float], unit: str, steps_per_epoch: int) -> None:
    if bar is None:
        return
    accuracy = {"acc": f"{metrics['train/accuracy']:.3f}"} if "train/accuracy" in metrics else {}
    loss = {"loss": f"{metrics['train/loss']:.4f}"} if "train/loss" in metrics else {}
    bar.set_postfix(**loss, **accuracy,
                    **{f"{unit}/s": f"{metrics.get(f'perf/{unit}_per_s', 0):.0f}"})
    bar.n = (at.step - 1) % steps_per_epoch + 1
    bar.refresh()


def close_bar(bar) -> None:
    if bar is not None:
        bar.close()
