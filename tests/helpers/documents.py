"""Token files of documents for the tests: text documents of every length made by prepare_text.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = "the a cat dog sat on mat ran far big red sun".split()


def document_directory(tmp_path: Path, n: int = 120, max_words: int = 60, seed: int = 0) -> Path:
    """``n`` text documents of 1 to ``max_words`` words (a few bytes to a few hundred) as token files of bytes,
    documents with boundaries (``--input documents``): the directory to pass as recipe.data.root."""
    from scripts.prepare_text import main

    rng = np.random.default_rng(seed)
    folder = tmp_path / "docs"
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"{i:04d}.txt").write_text(" ".join(rng.choice(WORDS, int(rng.integers(1, max_words)))) + ".")
    out = tmp_path / "tokens"
    main([*map(str, sorted(folder.iterdir())), "--input", "documents", "--output", str(out)])
    return out


def pairs_directory(tmp_path: Path, n: int = 160, seed: int = 0) -> Path:
    """``n`` prompt/completion pairs of 1-8 and 1-9 words as token files of bytes (``--input pairs``: the loss on
    the completions only, about half the tokens): the directory to pass as recipe.data.root."""
    import json

    from scripts.prepare_text import main

    rng = np.random.default_rng(seed)
    pairs = [{"prompt": " ".join(rng.choice(WORDS, int(rng.integers(1, 9)))) + "?",
              "completion": " " + " ".join(rng.choice(WORDS, int(rng.integers(1, 10))))} for _ in range(n)]
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    out = tmp_path / "tokens"
    main([str(source), "--input", "pairs", "--output", str(out), "--val-fraction", "0.2"])
    return out
