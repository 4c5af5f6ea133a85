"""``recipe.data.train_size``/``test_size`` on real data: a seeded random subset of each split."""
from __future__ import annotations

from typing import Optional

import torch

from trainer.run.errors import ConfigError
from trainer.recipe import Split, SplitLike

STREAMS = {"train": 1, "test": 2}  # one random stream per split, as recipes/image_folder.py draws its subsets


def seeded_subset(dataset: SplitLike, size: Optional[int], *, split: str, seed: int, where: str) -> SplitLike:
    """``size`` samples of ``dataset`` drawn at random without replacement (deterministic in ``seed``,
    kept in their order), or the whole dataset for None. ``split``: "train" or "test", which names
    the setting (``recipe.data.<split>_size``); ``where`` names the data in the message."""
    if size is None:
        return dataset
    key, n = f"recipe.data.{split}_size", len(dataset)
    if not 1 <= size <= n:
        raise ConfigError(f"{key}={size} but {where} has {n} samples: set {key} between 1 and {n}, "
                          "or null for all of them")
    g = torch.Generator().manual_seed(seed * 7919 + STREAMS[split])
    chosen = torch.randperm(n, generator=g)[:size].sort().values
    if isinstance(dataset, Split):
        return Split(dataset.x[chosen], dataset.y[chosen], {k: v[chosen] for k, v in dataset.extra_inputs.items()})
    return torch.utils.data.Subset(dataset, chosen.tolist())
