"""The global stream of optimizer steps: packed sequences -> micro-batches -> per-dp-rank assignment.

One step takes `dp_size * grad_accum * micro_batch_size` packed sequences off the stream; dp rank r receives micro-batches
r*grad_accum .. (r+1)*grad_accum-1 of the step. The stream position is counted in sequences, not steps, so a state saved
under one (dp_size, grad_accum, micro_batch_size) resumes exactly under another: no sequence replayed, none skipped.

State (JSON): {"version", "step", "stream": <node state>, "dataset", "blend_weights", "seq_len", "packing_window", "seed"}
and "eval_fraction" when documents are held out (heldout.py); all but the first three must match the server's, because
they define the stream itself.

CP size of a micro-batch (`MicroBatch.cp_size`, sent as `MicroBatchHeader.cp_size` and handed to the trainer as the
0-dim tensor `cp_size`): the number of context-parallel ranks that must split this micro-batch between them by zigzag
sharding. With one allowed size (static CP: `parallel.cp_sizes` empty, the size is `parallel.cp`) every micro-batch
carries that size. With several (dynamic CP), each micro-batch gets the smallest size under the budget
(`cp_sizing.choose_cp_size`) and the micro-batches of a step are dealt to dp ranks so that their summed work is even.
Every size divides `parallel.cp` (`cp_sizing.allowed_cp_sizes`): all CP peers of a dp rank receive the dp rank's
micro-batches, and the trainer's CP blocks split them (services/trainer/parallel/context_parallel.py `cp_share`: a
micro-batch sized c runs on one aligned block of c ranks, each block taking an equal share).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torchdata.nodes import Batcher

from services.dataloader.blend import BlendedSequences
from services.dataloader.cp_sizing import CPBudget, choose_cp_size, deal_by_cost, segment_lengths, work
from services.dataloader.dataset import IndexedDataset
from services.dataloader.errors import DataError
from services.dataloader.heldout import split_documents
from services.dataloader.packing import PackedSequences, Sequence

STATE_VERSION = 2  # 2: packing carries part-filled sequences into the next window (a different stream)


@dataclass
class MicroBatch:
    tensors: dict[str, torch.Tensor]  # tokens, labels, position_ids, cu_seqlens
    cp_size: int
    real_tokens: int

    @property
    def num_segments(self) -> int:
        return len(self.tensors["cu_seqlens"]) - 1


@dataclass
class Step:
    index: int
    per_rank: list[list[MicroBatch]]  # [dp_rank][micro]; empty for a dp rank another replica serves
    state_before: dict[str, Any]  # node state at the start of this step
    state_after: dict[str, Any] = field(default_factory=dict)  # full JSON state just after this step


def build_micro_batch(datasets: list[IndexedDataset], sequences: list[Sequence], seq_len: int) -> MicroBatch:
    """Concatenate `sequences` into one micro-batch in the trainer's contract format (T = len(sequences) * seq_len).

    `datasets[piece.source]` holds each piece's tokens; all datasets share one tokenizer, hence one pad id. A token
    its dataset's loss mask excludes (a prompt's) is no label: -100, as padding.
    """
    total = len(sequences) * seq_len
    tokens = np.full(total, datasets[0].pad_id, dtype=np.int64)
    labels = np.full(total, -100, dtype=np.int64)
    positions = np.zeros(total, dtype=np.int64)
    cu = [0]
    real = 0
    for b, seq in enumerate(sequences):
        at, end = b * seq_len, (b + 1) * seq_len
        for piece in seq:
            dataset = datasets[piece.source]
            toks = dataset.doc(piece.doc)[piece.start:piece.end]
            n = len(toks) - 1
            tokens[at:at + n] = toks[:-1]
            labels[at:at + n] = toks[1:]
            targets = dataset.doc_targets(piece.doc)
            if targets is not None:  # a prompt's tokens are no targets (prompt/completion records: preprocess.py)
                labels[at:at + n][~targets[piece.start + 1:piece.end]] = -100
            # A piece of a split document is a document of its own: attention cannot reach the earlier piece.
            positions[at:at + n] = np.arange(n)
            at += n
            cu.append(at)
        real += at - b * seq_len
        if at < end:  # the padding run is a segment too, so no document attends to it
            positions[at:end] = np.arange(end - at)
            cu.append(end)
    tensors = {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
               "position_ids": torch.from_numpy(positions), "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    return MicroBatch(tensors, cp_size=1, real_tokens=real)


class StepStream:
    """Produces `Step`s in order from a position; `reset(state)` moves to any saved position."""

    def __init__(self, datasets: list[IndexedDataset], data_cfg, dp_size: int, cp_sizes: list[int] | None = None):
        """`cp_sizes`: the CP sizes a micro-batch may be given (see the module docstring); None: [1]."""
        self.datasets, self.cfg, self.dp_size = datasets, data_cfg, dp_size
        self.cp_sizes = sorted(set(cp_sizes or [1]))
        tokens = data_cfg.micro_batch_size * data_cfg.seq_len
        for c in self.cp_sizes:
            if c < 1 or (c > 1 and tokens % (2 * c)):
                raise DataError(f"a micro-batch of data.micro_batch_size*data.seq_len = {tokens} tokens cannot be cut "
                                f"into 2*cp = {2 * c} equal zigzag chunks; make it a multiple of {2 * max(self.cp_sizes)}")
        self.budget = CPBudget(data_cfg.cp_max_tokens_per_rank, data_cfg.cp_max_attn_per_rank)
        self.sequences = self._sequences()
        per_step = dp_size * data_cfg.grad_accum * data_cfg.micro_batch_size
        self.node = Batcher(self.sequences, batch_size=per_step, drop_last=True)
        self.step = 0
        self.dp_ranks: set[int] | None = None  # dp ranks whose micro-batches `next_step` builds; None: all
        self.node.reset(None)
        self.initial_node_state = self.node.state_dict()

    def _sequences(self):
        """The node of packed sequences this stream cuts into steps."""
        datasets, cfg = self.datasets, self.cfg
        if len({str(d.meta["tokenizer"]) for d in datasets}) != 1:
            raise DataError("blended datasets were tokenized with different tokenizers; preprocess them with one")
        self._sources = [PackedSequences(d.packed_lengths(cfg.seq_len), cfg.seq_len, cfg.packing_window, cfg.seed, i,
                                         docs=split_documents(len(d), cfg.eval_fraction, cfg.seed)[0])
                         for i, d in enumerate(datasets)]
        if cfg.blend_weights:
            return BlendedSequences(self._sources, list(cfg.blend_weights), cfg.seed)
        if len(self._sources) == 1:
            return self._sources[0]
        raise DataError(f"{len(datasets)} datasets need `data.blend_weights` (one weight each)")

    def identity(self) -> dict[str, Any]:
        held_out = {"eval_fraction": self.cfg.eval_fraction} if self.cfg.eval_fraction else {}  # (older states lack it)
        return {"dataset": "+".join(d.fingerprint for d in self.datasets),
                "blend_weights": list(self.cfg.blend_weights), "seq_len": self.cfg.seq_len,
                "packing_window": self.cfg.packing_window, "seed": self.cfg.seed, **held_out}

    def state(self) -> dict[str, Any]:
        """Position before the next step this stream will produce."""
        return {"version": STATE_VERSION, "step": self.step, "stream": self.node.state_dict(), **self.identity()}

    def check(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(f"not a version-{STATE_VERSION} dataloader state: {str(state)[:200]}")
        mine = self.identity()
        keys = [*mine, *(["eval_fraction"] if "eval_fraction" in state and "eval_fraction" not in mine else [])]
        diff = {k: (state.get(k), mine.get(k)) for k in keys if state.get(k) != mine.get(k)}
        if diff:
            raise DataError("dataloader state was saved for another stream (saved, now): "
                            + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in diff.items())
                            + "; resume with the data config and dataset it was saved with")

    def reset(self, state: dict[str, Any] | None) -> None:
        if state is None:
            self.node.reset(None)
            self.step = 0
            return
        self.check(state)
        self.node.reset(state["stream"])
        self.step = int(state["step"])

    def next_step(self) -> Step:
        before = self.node.state_dict()
        seqs = next(self.node)
        mbs, ga = self.cfg.micro_batch_size, self.cfg.grad_accum
        chunks = [seqs[i:i + mbs] for i in range(0, len(seqs), mbs)]
        mine = [self.dp_ranks is None or r in self.dp_ranks for r in range(self.dp_size)]
        if len(self.cp_sizes) > 1:  # sizing and balancing see every micro-batch of the step, whoever serves it
            per_rank = self._size_and_balance([self.build(c) for c in chunks])
            per_rank = [got if keep else [] for got, keep in zip(per_rank, mine)]
        else:  # a dp rank another replica serves gets no micro-batches built here
            per_rank = [[self.build(c) for c in chunks[r * ga:(r + 1) * ga]] if mine[r] else []
                        for r in range(self.dp_size)]
            for mb in (mb for rank in per_rank for mb in rank):
                mb.cp_size = self.cp_sizes[0]
        step = Step(self.step, per_rank, before)
        self.step += 1
        step.state_after = self.state()
        return step

    def build(self, sequences: list[Sequence]) -> MicroBatch:
        return build_micro_batch(self.datasets, sequences, self.cfg.seq_len)

    def ready(self) -> bool:
        """Whether `next_step` can run without waiting for input (a corpus always can)."""
        return True

    def release(self, state: dict[str, Any]) -> None:
        """Every rank has moved past the position `state` (a node state): input before it may be discarded."""

    def _size_and_balance(self, micro: list[MicroBatch]) -> list[list[MicroBatch]]:
        costs = []
        for mb in micro:
            lengths = segment_lengths(mb.tensors["cu_seqlens"])
            mb.cp_size = choose_cp_size(lengths, self.cp_sizes, self.budget)
            costs.append(work(lengths, self.cfg.seq_len))
        groups = deal_by_cost(costs, self.dp_size, self.cfg.grad_accum)
        return [[micro[i] for i in g] for g in groups]

    @property
    def efficiency(self) -> float:
        return self.sequences.efficiency

    @property
    def epoch(self) -> int:
        return min(int(s.get_state()["epoch"]) for s in self._sources)
