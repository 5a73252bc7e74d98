"""Packing documents into fixed-length training sequences.

Units: a sequence has `seq_len` input positions. Inputs and labels shift inside each document, so a document of L
tokens fills L-1 positions (its last token, EOS, is only ever a label) and nothing is predicted across a document
boundary. A document longer than seq_len+1 tokens is cut into pieces of at most seq_len+1 tokens that overlap by one
token, so every label of the document is still predicted exactly once; every other document stays whole.

Within a window of documents, best-fit-decreasing puts each piece (longest first) into the fullest sequence that still
has room. A window runs out of short pieces before its last few sequences are full; instead of padding them, the
pieces of the emptiest ones (up to `CARRY_MAX_SEQUENCES` sequences' worth) are carried into the next window and packed
again with its documents. A piece is carried at most `CARRY_MAX_AGE` times, and the last window of an epoch carries
nothing, so every epoch still holds each document exactly once. This buys with a window of 256 documents the
efficiency that a window of 1024 reaches without carrying, at a resume state of at most a few hundred integers.

The stream is an endless sequence of epochs; each epoch shuffles the documents with `seed`, so the stream is a pure
function of (dataset, seq_len, window, seed), and a position in it is (epoch, window, emitted) plus the pieces carried
into that window.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

# A sequence with at most this fraction of padding is emitted as it is: holding it back gains little and grows the state.
CARRY_SLACK = 1 / 64
# Positions held back per window, in sequences: enough to refill a window's ragged tail, small enough to keep the state small.
CARRY_MAX_SEQUENCES = 4
# Windows a piece may wait for a better fit; bounds how far a document can drift from its place in the shuffle.
CARRY_MAX_AGE = 4


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of document `doc` of dataset `source`; fills end-start-1 input positions."""

    doc: int
    start: int
    end: int
    source: int = 0  # which dataset of a blend

    @property
    def positions(self) -> int:
        return self.end - self.start - 1


Sequence = list[Piece]


def split_document(doc: int, length: int, seq_len: int, source: int = 0) -> list[Piece]:
    """Whole document if it fits in one sequence; else consecutive pieces sharing one boundary token."""
    if length <= seq_len + 1:
        return [Piece(doc, 0, length, source)] if length > 1 else []
    return [Piece(doc, s, min(s + seq_len + 1, length), source) for s in range(0, length - 1, seq_len)]


def best_fit_decreasing(pieces: list[Piece], seq_len: int) -> list[Sequence]:
    """Sequences in order of creation; ties keep input order, so the result is deterministic."""
    order = sorted(range(len(pieces)), key=lambda i: -pieces[i].positions)  # stable: ties keep window order
    bins: list[Sequence] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin index), sorted: the best fit is the first with enough room
    for i in order:
        piece = pieces[i]
        need = piece.positions
        j = bisect.bisect_left(open_bins, (need, -1))
        if j < len(open_bins):
            room, b = open_bins.pop(j)
        else:
            room, b = seq_len, len(bins)
            bins.append([])
        bins[b].append(piece)
        if room - need > 0:
            bisect.insort(open_bins, (room - need, b))
    return bins


def pack_window(doc_ids: np.ndarray, lengths: np.ndarray, seq_len: int, source: int = 0,
                carried: list[Piece] | None = None) -> list[Sequence]:
    """Best-fit-decreasing over the pieces carried in from the previous window, then the window's documents."""
    pieces = list(carried or []) + [p for d in doc_ids for p in split_document(int(d), int(lengths[d]), seq_len, source)]
    return best_fit_decreasing(pieces, seq_len)


def hold_back(bins: list[Sequence], ages: dict[Piece, int], seq_len: int) -> set[int]:
    """Indices of the bins whose pieces go to the next window: the emptiest first, while they fit the carry budget.

    A bin is never held when it is within `CARRY_SLACK` of full or holds a piece that has waited `CARRY_MAX_AGE`
    windows already. Ties go to the lower index, so the choice is deterministic.
    """
    slack = int(seq_len * CARRY_SLACK)
    fills = [(sum(p.positions for p in b), i) for i, b in enumerate(bins)]
    held, budget = set(), CARRY_MAX_SEQUENCES * seq_len
    for fill, i in sorted(fills):
        if seq_len - fill <= slack or fill > budget:
            break  # ascending fill: every later bin is at least as full
        if all(ages.get(p, 0) < CARRY_MAX_AGE for p in bins[i]):
            held.add(i)
            budget -= fill
    return held


def efficiency(sequences: list[Sequence], seq_len: int) -> float:
    """Fraction of input positions holding document tokens rather than padding."""
    used = sum(p.positions for s in sequences for p in s)
    return used / (len(sequences) * seq_len) if sequences else 0.0


class PackedSequences(BaseNode[Sequence]):
    """Endless stream of packed sequences over one dataset.

    State: {"epoch", "window", "emitted", "carry"}. `emitted` counts the sequences of the current window already handed
    out and `carry` lists the pieces carried into it as [doc, start, end, age], so a restore repacks that one window
    (cheap, deterministic) and skips exactly those.
    """

    def __init__(self, lengths: np.ndarray, seq_len: int, window: int, seed: int, stream_id: int = 0,
                 docs: np.ndarray | None = None):
        """`stream_id`: the dataset's index in a blend; it tags pieces and decorrelates the shuffles of blended
        datasets. `docs`: the ids of the documents this stream packs (None: all; heldout.py splits them)."""
        super().__init__()
        self.docs = np.arange(len(lengths)) if docs is None else np.asarray(docs, dtype=np.int64)
        if len(self.docs) == 0 or int(np.max(lengths[self.docs])) < 2:
            raise ValueError("a dataset needs at least one document of two or more tokens to pack")
        self.lengths, self.seq_len, self.window = lengths, seq_len, max(1, window)
        self.seed, self.stream_id = seed, stream_id
        self.windows_per_epoch = -(-len(self.docs) // self.window)
        self.used_positions = 0  # statistics since this process started; not part of the position
        self.total_positions = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {"epoch": 0, "window": 0, "emitted": 0, "carry": []}
        self._epoch, self._window, self._emitted = int(st["epoch"]), int(st["window"]), int(st["emitted"])
        self._carry_in = [(Piece(int(d), int(s), int(e), self.stream_id), int(a)) for d, s, e, a in st["carry"]]
        self._perm_epoch = -1
        self._load_window()

    def _load_window(self) -> None:
        if self._perm_epoch != self._epoch:
            order = np.random.default_rng((self.seed, self.stream_id, self._epoch)).permutation(len(self.docs))
            self._perm = self.docs[order]
            self._perm_epoch = self._epoch
        ids = self._perm[self._window * self.window:(self._window + 1) * self.window]
        ages = dict(self._carry_in)
        bins = pack_window(ids, self.lengths, self.seq_len, self.stream_id, [p for p, _ in self._carry_in])
        last_of_epoch = self._window == self.windows_per_epoch - 1
        held = set() if last_of_epoch else hold_back(bins, ages, self.seq_len)
        self._carry_out = [(p, ages.get(p, 0) + 1) for i in sorted(held) for p in bins[i]]
        bins = [b for i, b in enumerate(bins) if i not in held]
        # Best-fit-decreasing creates sequences from the longest document down; shuffling them keeps
        # long and short documents mixed in the micro-batches that follow.
        order = np.random.default_rng((self.seed, self.stream_id, self._epoch, self._window)).permutation(len(bins))
        self._bins = [bins[i] for i in order]

    def next(self) -> Sequence:
        while self._emitted >= len(self._bins):
            self._window, self._emitted, self._carry_in = self._window + 1, 0, self._carry_out
            if self._window >= self.windows_per_epoch:
                self._epoch, self._window = self._epoch + 1, 0
            self._load_window()
        seq = self._bins[self._emitted]
        self._emitted += 1
        self.used_positions += sum(p.positions for p in seq)
        self.total_positions += self.seq_len
        return seq

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "window": self._window, "emitted": self._emitted,
                "carry": [[p.doc, p.start, p.end, age] for p, age in self._carry_in]}

    @property
    def efficiency(self) -> float:
        return self.used_positions / self.total_positions if self.total_positions else 0.0
