"""Whole documents packed into rows of ``context`` tokens: one static shape for a graphed step.

A graph wants one shape and text has every length. ``PackedDocuments`` is a map-style dataset
whose item ``i`` is one packed row, a dict of fixed-shape tensors:

- ``x`` [context]: the row's tokens, documents back to back, padding (``pad_id``) at the end;
- ``y`` [context] int64: the label of each position, ``IGNORE_INDEX`` (-100) where no loss is taken:
  a document's last token (no label carries one document into the next), tokens that are not
  targets (a conversation's prompt, when the loss is on the assistant's turns), padding;
- ``position_ids`` [context] int64: 0, 1, ... restarting at each document (and at the padding);
- ``document_ids`` [context] int32: 0, 1, ... for the row's documents, ``PADDING_DOCUMENT`` (-1)
  for its padding (a FlexAttention ``mask_mod`` reads it: same id and ``q >= kv``; padding then
  attends only to padding, so no query row is empty);
- ``cu_seqlens`` [max_documents + 2] int32: where each of the row's segments (its documents, then
  its padding if any) ends, after a leading 0, unused entries equal to ``context`` (empty
  documents), as varlen attention takes them; ``flatten_cu_seqlens`` turns a batch's rows into
  the one vector of the flattened ``[batch * context]`` tokens, ``cu_seqlens_from_document_ids``
  rebuilds it from ``document_ids`` on the device.

The packing rule is **best-fit decreasing within a shuffle buffer**: the documents are put in a
seeded order (``seed``, ``epoch``), a document longer than ``context`` is cut into pieces of
``context`` tokens (each piece packed, positioned and attended as a document of its own; the
label of a piece's last token is still the next token of its document), and each run of ``buffer``
pieces is sorted longest first and every piece placed in the open row whose free space fits it
most tightly, a new row when none fits. Rows left with free space stay open for the next buffer.
Why this rule: sequential greedy packing (fill a row, start the next when a document does not
fit) leaves the end of nearly every row empty: 13% padding at context 4096 and 18% at 2048 for
lognormal lengths around 300 tokens (sigma 1) up to 4096, where this rule leaves 0.02% and 0.02%
(50,000 documents; tests/test_documents.py checks <= 2%). Best fit decreasing is within 11/9 of
the optimal row count; the open rows carried across buffers take the short documents of later
buffers, so only the last rows of a split stay partly empty. Sorting only within a buffer keeps
rows a mix of lengths from across the split (a global sort would group the long documents in some
rows and the short in others) and the cost at O(n log n) in one pass. The loaders shuffle the
rows each epoch; ``for_epoch`` repacks with another document order when row compositions should
change too.

A bound on the loss tokens a row carries (``max_loss``: a head computed at the loss tokens only
sizes itself by it, recipes/chunked_head.py) is a second capacity: a piece goes to the tightest row
with room for its tokens and its loss tokens, looked for among a bounded number of the tightest and
the roomiest open rows; a piece with more loss tokens than the bound is cut where they reach it
(said, as long documents are). At a bound 5-10% above the data's share of loss tokens the padding
stays under 1% (tests/test_documents.py); nearer that share it grows, and the log says how much.

Everything is a function of the documents, ``context``, ``seed``, ``epoch``, ``buffer``,
``max_documents`` and ``max_loss``, so item ``i`` is the same in every process and every run: resuming mid-epoch
reads the same rows. Per row, ``real_tokens`` (not padding) and ``loss_tokens`` (labels that
count) are known on the host, for the trainer's counts and logs; on the device,
``document_ids >= 0`` marks real tokens and ``y != IGNORE_INDEX`` the loss tokens.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from trainer.recipe import IGNORE_INDEX  # noqa: F401 (read from here by the tests and recipes too)
from trainer.run.errors import ConfigError
PADDING_DOCUMENT = -1  # the document id of a row's padding
DEFAULT_BUFFER = 16384  # pieces sorted together: enough for well under 1% padding at a few hundred tokens each
FIELDS = ("x", "y", "position_ids", "document_ids", "cu_seqlens")
PREFIX_CHUNK = 1 << 24  # tokens summed at a time when counting loss tokens (memory stays bounded)
SCAN_ROWS = 64  # open rows a piece looks at for loss room under a loss bound (max_loss) before starting a new row


class Documents:
    """Documents stored back to back: document ``d`` is ``tokens[offsets[d]:offsets[d + 1]]``.

    ``targets`` (uint8, one per token, optional): 1 where the token is a target that carries loss
    (the label of the position before it counts), 0 where not (a conversation's prompt); None means
    every token of a document but its first. ``name`` names the documents in messages.
    Subclasses may map their arrays lazily (recipes/tokens.py maps files in each process).
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, targets: Optional[np.ndarray] = None,
                 name: str = "documents"):
        self._tokens, self._offsets, self._targets, self.name = tokens, np.asarray(offsets, np.int64), targets, name
        check_offsets(self.offsets, len(self.tokens), name)
        if targets is not None and len(targets) != len(tokens):
            raise ValueError(f"{name}: {len(targets)} loss-mask entries for {len(tokens)} tokens")

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens

    @property
    def offsets(self) -> np.ndarray:
        return self._offsets

    @property
    def targets(self) -> Optional[np.ndarray]:
        return self._targets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def check_offsets(offsets: np.ndarray, n_tokens: int, name: str) -> None:
    """Document offsets start at 0, never decrease and end at the token count; ValueError names what is wrong."""
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != n_tokens:
        raise ValueError(f"{name}: document offsets must run from 0 to the token count {n_tokens} "
                         f"(they are {len(offsets)} values from {offsets[:1].tolist()} to {offsets[-1:].tolist()})")
    if (np.diff(offsets) < 0).any():
        raise ValueError(f"{name}: document offsets decrease at document {int(np.argmax(np.diff(offsets) < 0))}")


@dataclass(frozen=True)
class PackingPlan:
    """Which pieces of which documents each row holds: row ``r`` is segments
    ``row_offsets[r]:row_offsets[r + 1]``, segment ``s`` being ``tokens[starts[s]:starts[s] + lengths[s]]``
    (``ends_document[s]``: it is its document's last piece)."""
    context: int
    row_offsets: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    ends_document: np.ndarray
    loss_tokens: np.ndarray  # per segment: the labels that count (``loss_tokens_of_pieces``)
    split_documents: int  # documents longer than the context
    pieces_of_split: int  # the pieces they became
    cut_for_loss: int = 0  # cuts made where a piece's loss tokens reached a row's bound (max_loss)

    @property
    def rows(self) -> int:
        return len(self.row_offsets) - 1

    def real_tokens(self) -> np.ndarray:
        """Tokens that are not padding, per row."""
        return np.add.reduceat(self.lengths, self.row_offsets[:-1]) if self.rows else np.zeros(0, np.int64)

    def documents_per_row(self) -> np.ndarray:
        return np.diff(self.row_offsets)


def seeded_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def cut_into_pieces(starts: np.ndarray, lengths: np.ndarray, context: int):
    """Each document as pieces of at most ``context`` tokens, in order: (starts, lengths, ends_document)."""
    per_document = -(-lengths // context)  # empty documents give no piece
    document = np.repeat(np.arange(len(lengths)), per_document)
    first_piece = np.cumsum(per_document) - per_document
    k = np.arange(len(document)) - first_piece[document]  # the piece's number within its document
    piece_starts = starts[document] + k * context
    piece_lengths = np.minimum(context, lengths[document] - k * context)
    return piece_starts, piece_lengths, k == per_document[document] - 1


def best_fit_decreasing(lengths: np.ndarray, context: int, buffer: int, max_documents: Optional[int],
                        loss: Optional[np.ndarray] = None, max_loss: Optional[int] = None) -> List[List[int]]:
    """Rows of piece indices: each run of ``buffer`` pieces longest first, each piece into the open row with
    the least free space that holds it (rows with free space stay open across buffers); a row closes when
    full or holding ``max_documents`` pieces.

    With ``max_loss``, a row's pieces also carry at most that many loss tokens (``loss``: each piece's): the
    piece goes to a row with room for both (``fitting_row``: a bounded search), a new row when none has; a row
    without loss room left closes."""
    rows: List[List[int]] = []
    free_sizes: List[int] = []  # sorted distinct free spaces of the open rows
    open_rows: Dict[int, List[int]] = {}  # free space -> open rows with that much
    loss_room: List[int] = []  # per row: the loss tokens it may still take
    for lo in range(0, len(lengths), buffer):
        chunk = np.arange(lo, min(lo + buffer, len(lengths)))
        for piece in chunk[np.argsort(-lengths[chunk], kind="stable")].tolist():
            need = int(lengths[piece])
            loss_need = int(loss[piece]) if max_loss is not None else 0
            row, free = fitting_row(free_sizes, open_rows, loss_room, need, loss_need)
            if row is None:
                row, free = len(rows), context
                rows.append([])
                loss_room.append(max_loss if max_loss is not None else 0)
            rows[row].append(piece)
            free -= need
            loss_room[row] -= loss_need
            if free > 0 and (max_documents is None or len(rows[row]) < max_documents) \
                    and (max_loss is None or loss_room[row] > 0):
                if free not in open_rows:
                    open_rows[free] = []
                    bisect.insort(free_sizes, free)
                open_rows[free].append(row)
    return rows


def fitting_row(free_sizes: List[int], open_rows: Dict[int, List[int]], loss_room: List[int], need: int,
                loss_need: int):
    """(row, its free space) of an open row with at least ``need`` free tokens and a loss room of at least
    ``loss_need``, taken out of the open rows; (None, 0) when none is found. Looked for among the ``SCAN_ROWS``
    tightest rows with the tokens, then among the ``SCAN_ROWS`` roomiest: rows short of loss room but not of tokens
    gather at the tight end, and the roomy end holds the rows opened since. Without a loss bound (every room 0,
    every need 0) the first row looked at fits: plain best fit."""
    first = bisect.bisect_left(free_sizes, need)
    for sizes in (range(first, len(free_sizes)), range(len(free_sizes) - 1, first - 1, -1)):
        looked = 0
        for k in sizes:
            free = free_sizes[k]
            bucket = open_rows[free]
            for j in range(len(bucket) - 1, -1, -1):  # the newest first
                if loss_room[bucket[j]] >= loss_need:
                    row = bucket.pop(j)
                    if not bucket:
                        del open_rows[free]
                        free_sizes.pop(k)
                    return row, free
                looked += 1
                if looked >= SCAN_ROWS:
                    break
            if looked >= SCAN_ROWS:
                break
    return None, 0


def plan_packing(documents: Documents, context: int, *, seed: int = 0, epoch: int = 0, buffer: int = DEFAULT_BUFFER,
                 split_long: bool = True, max_documents: Optional[int] = None, max_loss: Optional[int] = None,
                 split_key: str = "split_long_documents", context_key: str = "context",
                 loss_key: str = "max_loss_tokens") -> PackingPlan:
    """The rows of one packing of ``documents`` (the rule: the module docstring). A document longer than
    ``context`` is cut into pieces, or with ``split_long=False`` refused (ConfigError naming ``split_key`` and
    ``context_key``, the settings to change). ``max_loss``: the most loss tokens a row may carry; a piece with
    more is cut where they reach it (``cut_at_loss_bound``), or with ``split_long=False`` refused, naming
    ``loss_key``."""
    if context < 1 or buffer < 1 or (max_documents is not None and max_documents < 1) \
            or (max_loss is not None and max_loss < 1):
        raise ValueError(f"context={context}, buffer={buffer}, max_documents={max_documents} and "
                         f"max_loss={max_loss} must be positive")
    lengths = documents.lengths()
    order = seeded_order(len(lengths), seed, epoch)
    long = lengths > context
    if long.any() and not split_long:
        d = int(np.flatnonzero(long)[0])
        raise ConfigError(f"{documents.name}: document {d} has {int(lengths[d]):,} tokens, more than a row of "
                          f"{context_key}={context} ({int(long.sum()):,} documents are): set {split_key}=true to cut "
                          f"them into pieces, or a larger {context_key}")
    starts, piece_lengths, ends = cut_into_pieces(documents.offsets[:-1][order], lengths[order], context)
    piece_loss, cut_for_loss = loss_tokens_of_pieces(starts, piece_lengths, ends, documents.targets), 0
    if max_loss is not None:
        over = piece_loss > max_loss
        if over.any() and not split_long:
            p = int(np.flatnonzero(over)[0])
            d = int(np.searchsorted(documents.offsets, starts[p], side="right")) - 1
            raise ConfigError(f"{documents.name}: document {d} carries {int(piece_loss[p]):,} loss tokens, more than a "
                              f"row may hold with {loss_key}={max_loss} ({int(over.sum()):,} pieces do): set "
                              f"{split_key}=true to cut them where their loss tokens reach it, or raise {loss_key} "
                              f"(at most the context, {context})")
        starts, piece_lengths, ends, piece_loss, cut_for_loss = cut_at_loss_bound(
            starts, piece_lengths, ends, piece_loss, documents.targets, max_loss)
    rows = best_fit_decreasing(piece_lengths, context, buffer, max_documents, piece_loss, max_loss)
    members = np.fromiter((p for row in rows for p in row), dtype=np.int64, count=len(piece_lengths))
    row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(row) for row in rows], out=row_offsets[1:])
    return PackingPlan(context, row_offsets, starts[members], piece_lengths[members], ends[members],
                       piece_loss[members], int(long.sum()), int((-(-lengths[long] // context)).sum()), cut_for_loss)


def cut_at_loss_bound(starts: np.ndarray, lengths: np.ndarray, ends: np.ndarray, loss: np.ndarray,
                      targets: Optional[np.ndarray], max_loss: int):
    """Each piece with more than ``max_loss`` loss tokens cut where they reach it (as many times as it takes),
    the rest following it in order: (starts, lengths, ends_document, loss tokens, the cuts made). A cut piece
    is a document of its own to attention and positions, as a document longer than the context is; the label
    of its last token is still its document's next token, so no loss token is lost."""
    over = np.flatnonzero(loss > max_loss)
    if not len(over):
        return starts, lengths, ends, loss, 0
    parts = {}  # piece -> (starts, lengths, ends_document, loss) of its parts
    for p in over.tolist():
        start, length, end = int(starts[p]), int(lengths[p]), bool(ends[p])
        labelled = length - end
        counted = (np.ones(labelled, np.int64) if targets is None
                   else np.asarray(targets[start + 1:start + 1 + labelled], dtype=np.int64))
        reached = np.cumsum(counted)
        cuts, carried = [], 0
        while reached[-1] - carried > max_loss:  # the next part: the positions whose loss stays within the bound
            at = int(np.searchsorted(reached, carried + max_loss, side="right"))
            cuts.append(at)
            carried = int(reached[at - 1])
        bounds = [0, *cuts, length]
        part_loss = [int(reached[b - 1]) if b else 0 for b in bounds[1:-1]] + [int(reached[-1])]
        parts[p] = (np.array([start + b for b in bounds[:-1]]), np.diff(bounds),
                    np.array([False] * len(cuts) + [end]), np.diff([0, *part_loss]))
    counts = np.ones(len(starts), np.int64)
    counts[over] = [len(parts[p][0]) for p in over.tolist()]
    source = np.repeat(np.arange(len(starts)), counts)  # each new piece's piece before the cuts
    out = [starts[source], lengths[source], ends[source].astype(bool), loss[source].astype(np.int64)]
    first = np.cumsum(counts) - counts
    for p, columns in parts.items():
        for column, values in zip(out, columns):
            column[first[p]:first[p] + counts[p]] = values
    return (*out, int((counts - 1).sum()))


def sums_before(values: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``values[:p].sum()`` for each ``p`` of ``points``, reading ``values`` (a memory map, say) once in chunks."""
    order = np.argsort(points, kind="stable")
    sorted_points = points[order]
    out = np.zeros(len(points), dtype=np.int64)
    total, k = 0, 0
    for lo in range(0, len(values) + 1, PREFIX_CHUNK):
        hi = min(lo + PREFIX_CHUNK, len(values))
        chunk = np.cumsum(np.asarray(values[lo:hi], dtype=np.int64))
        end = np.searchsorted(sorted_points, hi, side="right")
        inside = sorted_points[k:end] - lo  # points in (lo, hi]: the sum of values before them ends in this chunk
        out[order[k:end]] = total + np.where(inside > 0, chunk[np.maximum(inside - 1, 0)], 0)
        total += int(chunk[-1]) if len(chunk) else 0
        k = end
    return out


def loss_tokens_of_pieces(starts: np.ndarray, lengths: np.ndarray, ends_document: np.ndarray,
                          targets: Optional[np.ndarray]) -> np.ndarray:
    """Labels that count in each piece: its positions whose next token, in the same document, is a target."""
    labelled = lengths - ends_document  # a document's last token has no label
    if targets is None:
        return labelled
    first = starts + 1  # the targets of a piece's labels are tokens [start + 1, start + 1 + labelled)
    return sums_before(targets, first + labelled) - sums_before(targets, first)


class PackedDocuments(torch.utils.data.Dataset):
    """Map-style dataset: item ``i`` is packed row ``i`` (fields: the module docstring).

    ``max_documents``: the most documents (pieces) a row may hold, which sizes ``cu_seqlens``
    (``max_documents + 2``); None takes the most this packing put in a row. Give the same value to
    every split and epoch whose batches share one graph. ``max_loss``: the most loss tokens a row may
    carry (None: no bound), what a head computed at the loss tokens only sizes itself by
    (recipes/chunked_head.py). ``x_dtype``: what ``x`` is held as (uint8 for bytes, int32 for wider
    ids, as recipes/tokens.py's ``input_dtype``).
    """

    def __init__(self, documents: Documents, context: int, *, seed: int = 0, epoch: int = 0,
                 buffer: int = DEFAULT_BUFFER, split_long: bool = True, max_documents: Optional[int] = None,
                 max_loss: Optional[int] = None, x_dtype=np.int32, pad_id: int = 0,
                 split_key: str = "split_long_documents", context_key: str = "context",
                 loss_key: str = "max_loss_tokens"):
        self.documents, self.context, self.seed, self.epoch, self.buffer = documents, int(context), seed, epoch, buffer
        self.split_long, self.max_loss, self.x_dtype, self.pad_id = split_long, max_loss, np.dtype(x_dtype), pad_id
        self.keys = {"split_key": split_key, "context_key": context_key, "loss_key": loss_key}
        self.plan = plan_packing(documents, self.context, seed=seed, epoch=epoch, buffer=buffer, split_long=split_long,
                                 max_documents=max_documents, max_loss=max_loss, **self.keys)
        per_row = self.plan.documents_per_row()
        self.max_documents = int(max_documents if max_documents is not None else (per_row.max() if len(per_row) else 1))
        self.real_tokens = self.plan.real_tokens()
        self.loss_tokens = (np.add.reduceat(self.plan.loss_tokens, self.plan.row_offsets[:-1]) if self.plan.rows
                            else np.zeros(0, np.int64))

    def for_epoch(self, epoch: int) -> "PackedDocuments":
        """The same documents packed in epoch ``epoch``'s order, with this packing's ``max_documents``."""
        return PackedDocuments(self.documents, self.context, seed=self.seed, epoch=epoch, buffer=self.buffer,
                               split_long=self.split_long, max_documents=self.max_documents, max_loss=self.max_loss,
                               x_dtype=self.x_dtype, pad_id=self.pad_id, **self.keys)

    def __len__(self) -> int:
        return self.plan.rows

    @property
    def padding_fraction(self) -> float:
        """Padding's share of all the rows' tokens."""
        total = self.plan.rows * self.context
        return 1.0 - float(self.real_tokens.sum()) / total if total else 0.0

    def describe(self) -> str:
        """One line for the log: the rule, the rows, the padding, the documents that were cut."""
        plan = self.plan
        cut = (f"; {plan.split_documents:,} documents longer than {self.context} tokens cut into "
               f"{plan.pieces_of_split:,} pieces" if plan.split_documents else "")
        bound = f" (at most {self.max_loss:,} a row)" if self.max_loss is not None else ""
        if plan.cut_for_loss:
            cut += f"; {plan.cut_for_loss:,} cuts where a piece's loss tokens reached a row's {self.max_loss:,}"
        return (f"{self.documents.name}: {len(self.documents):,} documents packed into {plan.rows:,} rows of "
                f"{self.context} tokens by best-fit decreasing in buffers of {self.buffer:,} pieces, "
                f"padding {100 * self.padding_fraction:.2f}% of tokens, {int(self.loss_tokens.sum()):,} loss tokens"
                f"{bound}{cut}")

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        plan, context = self.plan, self.context
        tokens, targets = self.documents.tokens, self.documents.targets
        x = np.full(context, self.pad_id, dtype=self.x_dtype)
        y = np.full(context, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(context, dtype=np.int64)
        document_ids = np.full(context, PADDING_DOCUMENT, dtype=np.int32)
        cu_seqlens = np.full(self.max_documents + 2, context, dtype=np.int32)
        cu_seqlens[0] = 0
        at = 0
        segments = range(plan.row_offsets[i], plan.row_offsets[i + 1])
        for k, s in enumerate(segments):
            start, length = int(plan.starts[s]), int(plan.lengths[s])
            labelled = length - bool(plan.ends_document[s])
            x[at:at + length] = tokens[start:start + length]
            labels = np.asarray(tokens[start + 1:start + 1 + labelled], dtype=np.int64)
            if targets is not None:
                labels = np.where(np.asarray(targets[start + 1:start + 1 + labelled]) != 0, labels, IGNORE_INDEX)
            y[at:at + labelled] = labels
            positions[at:at + length] = np.arange(length)
            document_ids[at:at + length] = k
            at += length
            cu_seqlens[k + 1] = at
        if at < context:  # the padding: one more segment, positions from 0, attending to itself only
            positions[at:] = np.arange(context - at)
            cu_seqlens[len(segments) + 1] = context
        return {"x": torch.from_numpy(x), "y": torch.from_numpy(y), "position_ids": torch.from_numpy(positions),
                "document_ids": torch.from_numpy(document_ids), "cu_seqlens": torch.from_numpy(cu_seqlens)}


def cu_seqlens_from_document_ids(document_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Each row's ``cu_seqlens`` ([batch, length] int32: 0, the end of each segment, then ``context``) from its
    ``document_ids`` [batch, context], on their device, in fixed shapes (graph-safe). ``length`` must be at
    least the most segments in a row + 1 (``PackedDocuments``: ``max_documents + 2``)."""
    batch, context = document_ids.shape
    j = torch.arange(1, context, device=document_ids.device)
    changes = torch.where(document_ids[:, 1:] != document_ids[:, :-1], j, context)  # where a new segment begins
    ends = torch.sort(changes, dim=1).values[:, :length - 1]
    if ends.shape[1] < length - 1:
        ends = torch.cat([ends, ends.new_full((batch, length - 1 - ends.shape[1]), context)], dim=1)
    return torch.cat([ends.new_zeros(batch, 1), ends], dim=1).to(torch.int32)


def flatten_cu_seqlens(cu_seqlens: torch.Tensor, context: int) -> torch.Tensor:
    """One ``cu_seqlens`` for a batch's rows laid end to end (``[batch * context]`` tokens, as varlen attention
    takes them): [batch * (length - 1) + 1] int32, 0, every segment's end offset by its row, then unused
    entries equal to the total. Fixed shapes, on the input's device (graph-safe)."""
    batch = cu_seqlens.shape[0]
    total = batch * context
    rows = torch.arange(batch, device=cu_seqlens.device, dtype=torch.int64)[:, None] * context
    ends = (cu_seqlens[:, 1:].to(torch.int64) + rows).flatten()
    previous = torch.cat([ends.new_zeros(1), ends[:-1]])
    ends = torch.where(ends == previous, total, ends)  # a row's unused entries repeat its end: move them last
    ends = torch.sort(ends).values
    return torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
