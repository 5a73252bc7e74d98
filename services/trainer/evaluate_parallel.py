"""`foldmoe evaluate` over `run.nproc` ranks: a checkpoint too large for one device, in the trainer's folded layout.

`foldmoe evaluate ... run.nproc=N` starts N ranks under torchrun (`torchrun_command`), each running the evaluation
with WORLD_SIZE set (services/trainer/evaluate_checkpoint.py). Every rank builds its slices of the layout the config's
`parallel` section describes (tp, cp, ep, etp, pp, as training builds them) and reads its boxes of the checkpoint,
whatever layout saved it (services/trainer/parallel/checkpoint_shards.py), in the dtype the one-process evaluation
uses (bf16 on a GPU under run.dtype=bf16, else fp32), every expert keeping every token.

Every rank reads the same sequences and builds the same micro-batches of `data.micro_batch_size` sequences (the last
one padded with empty rows: no loss token, and every micro-batch has the shape the layout cuts); data-parallel rank
d runs micro-batches d, d + dp, d + 2 dp, ... a round of dp of them at a time, and in the last round a rank without
one runs a copy of the round's first with no loss token (the expert all-to-alls and the pipeline are collective: every
rank runs every round). Each rank counts every micro-batch's loss tokens, so `--max-tokens` stops every rank after the
same micro-batch; the loss sums are summed over the ranks. The result is the one-process evaluation's
(tests/test_evaluate_parallel.py).
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.config import Config
from services.dataloader.dataset import IndexedDataset
from services.dataloader.packing import Sequence
from services.dataloader.stream import build_micro_batch
from services.trainer import checkpointing
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.model.transformer import MoETransformer
from services.trainer.parallel.context_parallel import cp_share, shard_micro_batch
from services.trainer.parallel.groups import ParallelGroups, init_groups, sum_over
from services.trainer.parallel.pipeline import loss_forward_pipeline
from services.trainer.step import count_loss_tokens
from services.trainer.train import Runtime, init_runtime, model_slices

MicroBatch = dict[str, torch.Tensor]


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """`foldmoe evaluate` with `argv` as `nproc` ranks on this machine (torchrun without the venv's bin/ on PATH)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "services.trainer.evaluate_checkpoint", *argv]


def start(cfg: Config) -> tuple[Runtime, ParallelGroups]:
    """The process group and the layout's groups (`cfg.model` must be the checkpoint's: the layout is checked
    against it)."""
    rt = init_runtime(cfg)
    return rt, init_groups(cfg, rt.world_size, rt.rank)


def rank_zero_first(rt: Runtime, work):
    """`work()` on rank 0, then on the others (what rank 0 writes, e.g. a tokenized corpus, they read)."""
    if rt.rank != 0:
        dist.barrier()
    out = work()
    if rt.rank == 0:
        dist.barrier()
    return out


def load_folded_model(cfg: Config, rt: Runtime, groups: ParallelGroups, checkpoint: Path) -> MoETransformer:
    """This rank's slices of `cfg.model` on its device (as the trainer builds them), read from `checkpoint`, in eval
    mode."""
    model, shapes = model_slices(cfg, rt, groups)
    checkpointing.load_weights(checkpoint, cfg, model, groups, shapes)
    if rt.device.type == "cuda" and cfg.run.dtype == "bf16":
        model.to(torch.bfloat16)  # the one-process evaluation's weights
    return model.eval()


def micro_batches(datasets: list[IndexedDataset], sequences: Iterable[Sequence], seq_len: int, batch: int,
                   max_tokens: int, seen: list[int]) -> Iterator[MicroBatch]:
    """Micro-batches of `batch` sequences (the last padded with empty rows: no loss token), until `max_tokens` (> 0)
    loss tokens are counted; `seen` = [sequences, loss tokens] so far. The one-process evaluation reads them too."""
    it = iter(sequences)
    while chunk := list(itertools.islice(it, batch)):
        mb = build_micro_batch(datasets, chunk + [[]] * (batch - len(chunk)), seq_len).tensors
        seen[0] += len(chunk)
        seen[1] += count_loss_tokens([mb])
        yield mb
        if max_tokens and seen[1] >= max_tokens:
            return


def evaluate_folded(model: MoETransformer, cfg: Config, rt: Runtime, groups: ParallelGroups,
                    datasets: list[IndexedDataset], sequences: Iterable[Sequence], max_tokens: int = 0,
                    progress=None) -> tuple[float, int, int, float]:
    """(mean loss, loss tokens, sequences, seconds) over `sequences`, every rank of the layout calling it alike;
    `progress(n)` is called with the sequences of each round."""
    d, p = cfg.data, cfg.parallel
    dp, me = groups.dp.size, groups.dp.rank
    seen = [0, 0]
    rounds = micro_batches(datasets, sequences, d.seq_len, d.micro_batch_size, max_tokens, seen)
    loss = torch.zeros((), dtype=torch.float64, device=rt.device)
    start_time = time.perf_counter()
    before = 0
    while batch := list(itertools.islice(rounds, dp)):
        mb = batch[me] if me < len(batch) else {**batch[0], "labels": torch.full_like(batch[0]["labels"],
                                                                                       IGNORE_INDEX)}
        local = [shard_micro_batch(m, groups, p.cp_comm, cfg.model.mtp_num_layers)
                 for m in cp_share([mb], groups.cp.size, groups.cp.rank)]
        with torch.no_grad():
            loss += loss_forward_pipeline(model, local, rt.device, None, groups.pp.group,
                                          groups.tp.size if p.sequence_parallel else 1).double()
        if progress is not None:
            progress(seen[0] - before)
            before = seen[0]
    loss = sum_over(loss.reshape(1), groups.dp_cp, groups.pp)[0]
    return float(loss) / max(seen[1], 1), seen[1], seen[0], time.perf_counter() - start_time
