"""The held-out split: documents kept out of training, and the micro-batches the evaluation loss is measured on.

A validation corpus of the user's own (`data.eval_corpus`) replaces the split: its documents are the held-out ones,
packed and dealt the same way, and the training stream keeps every document of `data.corpus`.

`data.eval_fraction` of each dataset's documents (at least one), drawn once from `data.seed`, never enter the training
stream (stream.py packs the others). The evaluation set packs the held-out documents as training packs its own (same
`seq_len`, window and seed, one epoch, each document once) into the first `data.eval_micro_batches` micro-batches of
`data.micro_batch_size` sequences, the datasets of a blend taking turns sequence by sequence. It is the same set at
every evaluation and under every parallel layout, so evaluations compare across steps and runs: micro-batch j goes to
dp rank j % dp_size, and the loss is their token-weighted mean (services/trainer/evaluate.py).
"""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np

from services.dataloader.dataset import IndexedDataset
from services.dataloader.errors import DataError
from services.dataloader.packing import PackedSequences, Sequence

HELD_OUT_DRAW = 0x5EED  # mixed into the draw's seed: the held-out documents do not follow from the shuffles' seeds


def split_documents(num_docs: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, held-out ids), each ascending: round(fraction * num_docs) documents held out, at least one when
    `fraction` > 0; none when it is 0."""
    if fraction <= 0:
        return np.arange(num_docs), np.arange(0)
    held = max(1, round(fraction * num_docs))
    if held >= num_docs:
        raise DataError(f"`data.eval_fraction={fraction}` holds out {held} of the dataset's {num_docs} documents, "
                        "leaving none to train on; lower it or add documents")
    chosen = np.zeros(num_docs, dtype=bool)
    chosen[np.random.default_rng((seed, HELD_OUT_DRAW)).choice(num_docs, held, replace=False)] = True
    return np.flatnonzero(~chosen), np.flatnonzero(chosen)


def one_epoch(source: PackedSequences) -> Iterator[Sequence]:
    """The source's first epoch from its start, sequence by sequence: each of its documents once."""
    source.reset(None)
    while True:
        seq = source.next()
        if source.get_state()["epoch"]:  # the next epoch's first sequence: every document is packed
            return
        yield seq


def eval_sequences(datasets: list[IndexedDataset], data_cfg, whole: bool = False) -> list[list[Sequence]]:
    """The evaluation set of the run (module docstring): `data.eval_micro_batches` lists of `data.micro_batch_size`
    packed sequences, from the documents `data.eval_fraction` holds out of `datasets`, or (`whole`: the
    `data.eval_corpus` datasets) from all of theirs."""
    cfg = data_cfg
    mbs, need = cfg.micro_batch_size, cfg.eval_micro_batches * cfg.micro_batch_size
    source = "`data.eval_corpus`" if whole else f"the documents `data.eval_fraction={cfg.eval_fraction}` holds out"
    epochs = []
    for i, d in enumerate(datasets):
        docs = None if whole else split_documents(len(d), cfg.eval_fraction, cfg.seed)[1]
        try:
            packed = PackedSequences(d.packed_lengths(cfg.seq_len), cfg.seq_len, cfg.packing_window, cfg.seed, i,
                                     docs=docs)
            epochs.append(list(itertools.islice(one_epoch(packed), need)))
        except ValueError:
            raise DataError(f"{source} ({d.path}): every document is shorter than two tokens") from None
    turns = itertools.chain.from_iterable(itertools.zip_longest(*epochs))
    sequences = [s for s in turns if s is not None]
    if len(sequences) < need:
        more = "add documents to data.eval_corpus" if whole else "raise eval_fraction"
        raise DataError(f"{source} pack{'s' if whole else ''} into {len(sequences)} sequences of {cfg.seq_len} "
                        f"tokens, fewer than `data.eval_micro_batches` x `data.micro_batch_size` = "
                        f"{cfg.eval_micro_batches} x {mbs}: {more} or lower eval_micro_batches")
    return [sequences[j * mbs:(j + 1) * mbs] for j in range(cfg.eval_micro_batches)]
