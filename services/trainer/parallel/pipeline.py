"""Pipeline parallelism: layers split into stages, and the 1F1B schedule that runs a step's micro-batches through them.

A stage is the model itself with the modules it does not own removed (the embedding lives on the first stage; the final
norm, output layer, loss and multi-token prediction depths on the last), so parameter names stay the single-device ones
and checkpoints need no renaming. Between stages travel hidden states [T_local, h] (T_local / tp with sequence
parallelism; [T_local, (1 + D) h] with D MTP depths, whose input embeddings ride along) forward and their gradients
backward; both sides know the shape from the micro-batch's token count, so no shapes are exchanged.
With virtual stages (`parallel.pp_virtual` = V) the layers are cut into pp·V chunks and a rank's stage holds V of them
(`rank_chunks`: rank r holds chunks r, r+pp, ...), which it runs one at a time (the model's forward takes the chunk's
layer ids); the schedules then take their interleaved form (pipeline_interleaved.py).

The schedules (`one_f_one_b`, and `forward_only` for passes without gradients) move hidden states and know nothing of
the loss: the caller supplies the stage's forward of one micro-batch (`StageForward`), which on the last stage turns
the model's output into the loss (pre-training: the model's cross-entropy, `forward_backward_pipeline`; RL: the
policy loss on per-token log-probs, rl/pipelined.py).

MoE aux losses need no plumbing: each MoE layer attaches its aux-loss gradient to its output (`AttachAuxLoss`), so the
backward of a stage (or chunk) started from the received activation gradient also back-propagates its aux losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from services.common.config import ModelConfig
from services.trainer.model.moe.experts import fp8_weights_held
from services.trainer.parallel.context_parallel import bind_micro_batch
from services.trainer.parallel.differentiable import group_rank, group_size
from services.trainer.parallel.micro_batch_pairs import pair_forward
from services.trainer.parallel.pipeline_interleaved import interleaved_forward_backward, interleaved_forward_only
from services.trainer.parallel.pipeline_split import cost_balanced_counts, even_counts
from services.trainer.step import to_device

ProcessGroup = dist.ProcessGroup


def stage_layers(num_layers: int, pp_size: int, pp_layers: list[int] | None = None, virtual: int = 1,
                 model_cfg: ModelConfig | None = None, seq_len: int = 0) -> list[range]:
    """Layer ids of each of the pp_size * virtual model chunks, in model order (with `virtual` 1 a chunk is a stage):
    `pp_layers` counts per chunk; else, given the model's config, the split that balances the chunks' FLOPs at
    `seq_len` (pipeline_split.py); else as even as possible (earlier chunks take the extra)."""
    chunks = pp_size * virtual
    if pp_layers:
        if len(pp_layers) != chunks or sum(pp_layers) != num_layers or min(pp_layers) < 1:
            per = "stage" if virtual == 1 else "model chunk"
            raise ValueError(f"`parallel.pp_layers={pp_layers}` must have one positive entry per {per} "
                             f"(pp*pp_virtual = {pp_size}*{virtual}) summing to num_layers={num_layers}")
        counts = list(pp_layers)
    elif chunks > num_layers:
        raise ValueError(f"`parallel.pp={pp_size}` x `parallel.pp_virtual={virtual}` exceeds "
                         f"`model.num_layers={num_layers}`")
    elif model_cfg is not None:
        if model_cfg.num_layers != num_layers:
            raise ValueError(f"a model of {model_cfg.num_layers} layers cannot be split as one of {num_layers}")
        counts = cost_balanced_counts(model_cfg, chunks, seq_len)
    else:
        counts = even_counts(num_layers, chunks)
    starts = [sum(counts[:c]) for c in range(chunks)]
    return [range(starts[c], starts[c] + counts[c]) for c in range(chunks)]


def rank_chunks(num_layers: int, pp_size: int, rank: int, pp_layers: list[int] | None = None,
                virtual: int = 1, model_cfg: ModelConfig | None = None, seq_len: int = 0) -> list[range]:
    """The chunks pipeline rank `rank` holds: rank, rank + pp_size, ... (interleaved 1F1B's layout, in which a
    micro-batch visits the ranks in order `virtual` times: rank 0 holds the first chunk, the last rank the last)."""
    return stage_layers(num_layers, pp_size, pp_layers, virtual, model_cfg, seq_len)[rank::pp_size]


def keep_stage(model: nn.Module, size: int, rank: int, pp_layers: list[int] | None = None,
               virtual: int = 1, *, seq_len: int) -> nn.Module:
    """Reduce `model` (in place) to pipeline rank `rank`'s stage of `size`: its chunks' layers (`pp_layers`, else
    balanced by FLOPs at `seq_len`), the embedding if it holds the first chunk, the final norm and output layer if it
    holds the last."""
    if size == 1:
        return model
    chunks = rank_chunks(len(model.layers), size, rank, pp_layers, virtual, model.cfg, seq_len)
    owned = {i for chunk in chunks for i in chunk}
    for layer_id in list(model.layers.keys()):
        if int(layer_id) not in owned:
            del model.layers[layer_id]
    if rank != 0:
        model.embed = None
    if rank != size - 1:
        model.norm = None
        model.output = None
        model.mtp = None  # multi-token prediction runs after the last layer; its inputs come down the pipeline
    return model


def apply_pipeline(model: nn.Module, pp_group: ProcessGroup | None, pp_layers: list[int] | None = None,
                   virtual: int = 1, *, seq_len: int) -> nn.Module:
    """Reduce `model` (in place) to this rank's stage; before tensor parallelism, so only owned modules get sharded."""
    return keep_stage(model, group_size(pp_group), group_rank(pp_group), pp_layers, virtual, seq_len=seq_len)


def held_chunks(model_stage: nn.Module) -> list[range]:
    """The layer ranges a stage runs one at a time: the runs of consecutive layer ids it holds. A rank's chunks are
    separated by the other ranks' (each at least one layer), so these are exactly its `rank_chunks`; one range for a
    plain stage or a whole model."""
    runs: list[range] = []
    for i in sorted(int(k) for k in model_stage.layers.keys()):
        if runs and runs[-1].stop == i:
            runs[-1] = range(runs[-1].start, i + 1)
        else:
            runs.append(range(i, i + 1))
    return runs


# ---------------------------------------------------------------- point-to-point


# (micro-batch index, the hidden states received from the previous chunk, None for the first chunk, index of the chunk
# among the rank's `StageLink.chunks`) -> that chunk's output: hidden states for the next chunk, or for the model's
# last chunk (`StageLink.holds_loss`) whatever the caller computes from the model's output (the micro-batch's summed
# loss when training; e.g. per-token log-probs in a forward-only pass). Without virtual stages the chunk is always 0.
StageForward = Callable[[int, torch.Tensor | None, int], torch.Tensor]


@dataclass
class StageLink:
    """This stage's neighbours and what travels between them: the hidden states of micro-batch i, [tokens[i] / sp, h]
    (sp: the TP size when sequence parallelism splits them along tokens, else 1), forward, and their gradients
    backward. Both sides know the shape from the micro-batch's token count, so no shapes are exchanged.

    The stage runs its layers as `chunks` (layer id ranges): one, or with virtual stages (`parallel.pp_virtual`) one
    per virtual stage, and then hidden states also travel from the last rank to the first (pipeline_interleaved.py).
    """

    group: ProcessGroup | None  # None: a single stage
    rank: int
    size: int
    tokens: list[int]  # per micro-batch, as the stage's model sees them (whole, before any sequence-parallel split)
    sp: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    chunks: list[range]  # layer ids of each chunk the stage runs, in model order (`held_chunks`)

    @classmethod
    def of(cls, model_stage: nn.Module, tokens: list[int], device: torch.device, pp_group: ProcessGroup | None,
           sequence_parallel_size: int = 1) -> "StageLink":
        hidden_size = next(b for b in model_stage.layers.values()).attn_norm.weight.shape[0]
        if group_size(pp_group) > 1:  # the MTP depths' input embeddings travel with the stream (transformer.py)
            hidden_size *= 1 + model_stage.cfg.mtp_num_layers
        dtype = next(model_stage.parameters()).dtype
        return cls(pp_group, group_rank(pp_group), group_size(pp_group), list(tokens), sequence_parallel_size,
                   hidden_size, dtype, device, held_chunks(model_stage))

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def virtual(self) -> int:
        return len(self.chunks)

    def holds_loss(self, chunk: int) -> bool:
        """Whether the rank's `chunk` is the model's last: its output is the model's (logits, loss), not hidden
        states."""
        return self.last and chunk == len(self.chunks) - 1

    def buffer(self, i: int) -> torch.Tensor:
        if self.tokens[i] % self.sp:
            raise ValueError(f"micro-batch {i} has {self.tokens[i]} tokens, not divisible by the sequence-parallel "
                             f"size {self.sp}")
        return torch.empty(self.tokens[i] // self.sp, self.hidden_size, dtype=self.dtype, device=self.device)

    def exchange(self, send: list[tuple[torch.Tensor, int]], recv: list[tuple[torch.Tensor, int]]) -> None:
        """Post every send and receive of one schedule slot together, then wait: neighbours that both send before they
        receive cannot deadlock. Peers are offsets (+1: next, -1: previous) on the ring of pp ranks; only virtual
        stages wrap around it. Tensors to one peer are received there in the order they are listed."""
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=(self.rank + d) % self.size) for t, d in send]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=(self.rank + d) % self.size) for t, d in recv]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def buffers(self, unit: list[int]) -> list[torch.Tensor]:
        return [self.buffer(i) for i in unit]

    # Each call moves the tensors of one schedule unit (one micro-batch, or a pair under `parallel.ep_overlap`) in one
    # exchange; both neighbours list a unit's micro-batches in the same order, so sends and receives match.

    def recv_forward(self, unit: list[int]) -> list[torch.Tensor] | None:
        if self.first:
            return None
        bufs = self.buffers(unit)
        self.exchange([], [(b, -1) for b in bufs])
        return bufs

    def send_forward(self, outs: list[torch.Tensor] | None) -> None:
        if not self.last:
            self.exchange([(o, +1) for o in outs], [])

    def recv_backward(self, unit: list[int]) -> list[torch.Tensor] | None:
        if self.last:
            return None
        bufs = self.buffers(unit)
        self.exchange([], [(b, +1) for b in bufs])
        return bufs

    def send_backward(self, grads: list[torch.Tensor | None]) -> None:
        if not self.first:
            self.exchange([(g, -1) for g in grads], [])

    def send_forward_recv_backward(self, outs: list[torch.Tensor] | None, unit: list[int]) -> list[torch.Tensor] | None:
        if self.last:
            return None
        bufs = self.buffers(unit)
        self.exchange([(o, +1) for o in outs], [(b, +1) for b in bufs])
        return bufs

    def send_backward_recv_forward(self, grads: list[torch.Tensor | None], unit: list[int]) -> list[torch.Tensor] | None:
        if self.first:
            return None
        bufs = self.buffers(unit)
        self.exchange([(g, -1) for g in grads], [(b, -1) for b in bufs])
        return bufs


# ---------------------------------------------------------------- the 1F1B schedule


# Several micro-batches' forward through one chunk at once, interleaved (`micro_batch_pairs.pair_forward`): (indices,
# their received hidden states or Nones, chunk) -> their outputs, as `StageForward` gives them one by one.
UnitForward = Callable[[list[int], list[torch.Tensor | None], int], list[torch.Tensor]]


class _StageRunner:
    """Forward/backward of one schedule unit (a micro-batch, or a pair) through one of this stage's chunks, keeping
    what backward needs (by micro-batch and chunk: with virtual stages a micro-batch is alive in several chunks)."""

    def __init__(self, unit_forward: UnitForward, link: StageLink, step_tokens: int | torch.Tensor):
        self.unit_forward, self.link, self.step_tokens = unit_forward, link, step_tokens
        self.inputs: dict[tuple[int, int], torch.Tensor | None] = {}  # by (micro-batch, chunk)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.loss = torch.zeros((), device=link.device)

    def forward(self, unit: list[int], hiddens: list[torch.Tensor] | None, chunk: int = 0) -> list[torch.Tensor] | None:
        hiddens = hiddens if hiddens is not None else [None] * len(unit)
        for h in hiddens:
            if h is not None:
                h.requires_grad_(True)
        outs = self.unit_forward(unit, hiddens, chunk)
        loss = self.link.holds_loss(chunk)
        for i, h, out in zip(unit, hiddens, outs, strict=True):
            self.inputs[i, chunk] = h
            if loss:  # the micro-batch's summed loss
                self.loss += out.detach()
                self.outputs[i, chunk] = out / self.step_tokens
            else:
                self.outputs[i, chunk] = out
        return None if loss else [out.detach().contiguous() for out in outs]

    def backward(self, unit: list[int], grads: list[torch.Tensor] | None, chunk: int = 0) -> list[torch.Tensor | None]:
        """One backward for the whole unit (so a pair's backward interleaves like its forward)."""
        outs, hiddens = [self.outputs.pop((i, chunk)) for i in unit], [self.inputs.pop((i, chunk)) for i in unit]
        torch.autograd.backward(outs, grad_tensors=grads)
        return [None if h is None else h.grad for h in hiddens]


def one_f_one_b(stage_forward: StageForward, link: StageLink, step_tokens: int | torch.Tensor,
                unit_forward: UnitForward | None = None, unit_size: int = 1) -> torch.Tensor:
    """Forward and backward of every micro-batch of `link.tokens` through the pipeline; `stage_forward` returns the
    micro-batch's summed loss on the last stage, which the schedule divides by `step_tokens` (≥ 1: a host number, or a
    0-d tensor on the device, where the folded pre-training step's all-reduced count stays) before its backward.
    Returns the summed loss on the last stage (zero elsewhere).

    The schedule moves units of `unit_size` consecutive micro-batches (the last one may be shorter): with a
    `unit_forward` that interleaves them (`parallel.ep_overlap`, unit_size 2), one backward per unit.
    Stage s runs min(P-1-s, U) warm-up unit forwards, then alternates one forward with one backward, then drains the
    backwards: at most P-s units' activations are alive on stage s, instead of all U with all-forward-then-backward.
    With virtual stages (several chunks per rank) the interleaved form of the schedule runs instead
    (pipeline_interleaved.py).
    """
    if unit_forward is None:
        unit_forward = lambda unit, hiddens, chunk: [stage_forward(i, h, chunk)  # noqa: E731
                                                     for i, h in zip(unit, hiddens)]
    run = _StageRunner(unit_forward, link, step_tokens)
    M = len(link.tokens)
    units = [list(range(i, min(i + unit_size, M))) for i in range(0, M, unit_size)]
    if link.virtual > 1:
        interleaved_forward_backward(run, link, units)
        return run.loss
    U = len(units)
    warmup = min(link.size - 1 - link.rank, U)
    for u in units[:warmup]:
        link.send_forward(run.forward(u, link.recv_forward(u)))
    steady = U - warmup
    hiddens = link.recv_forward(units[warmup]) if steady else None
    for j in range(steady):
        fwd, bwd = units[warmup + j], units[j]
        outs = run.forward(fwd, hiddens)
        grads = link.send_forward_recv_backward(outs, bwd)
        grads_in = run.backward(bwd, grads)
        if j == steady - 1:
            link.send_backward(grads_in)
        else:
            hiddens = link.send_backward_recv_forward(grads_in, units[warmup + j + 1])
    for u in units[steady:]:
        link.send_backward(run.backward(u, link.recv_backward(u)))
    return run.loss


def forward_only(stage_forward: StageForward, link: StageLink, unit_forward: UnitForward | None = None,
                 unit_size: int = 1) -> list[torch.Tensor | None]:
    """Every micro-batch of `link.tokens` forward through the pipeline, in order, without autograd: the last stage's
    outputs of `stage_forward` (e.g. per-token log-probs), None on the other stages. Units of `unit_size` consecutive
    micro-batches move as in `one_f_one_b` (with a `unit_forward` that interleaves a pair's forwards,
    `parallel.ep_overlap`). Nothing is kept for a backward, so no stage holds more than one unit's activations. With
    virtual stages, `interleaved_forward_only`."""
    if unit_forward is None:
        unit_forward = lambda unit, hiddens, chunk: [stage_forward(i, h, chunk)  # noqa: E731
                                                     for i, h in zip(unit, hiddens)]
    M = len(link.tokens)
    units = [list(range(i, min(i + unit_size, M))) for i in range(0, M, unit_size)]
    if link.virtual > 1:
        return interleaved_forward_only(unit_forward, link, units)
    outs: list[torch.Tensor | None] = [None] * M
    with torch.no_grad():
        for unit in units:
            received = link.recv_forward(unit)
            results = unit_forward(unit, received if received is not None else [None] * len(unit), 0)
            if link.last:
                for i, out in zip(unit, results, strict=True):
                    outs[i] = out
            else:
                link.send_forward([out.contiguous() for out in results])
    return outs


# ---------------------------------------------------------------- pre-training


def forward_backward_pipeline(model_stage: nn.Module, micro_batches: list[dict[str, torch.Tensor]],
                              step_tokens: int | torch.Tensor, device: torch.device,
                              autocast_dtype: torch.dtype | None, pp_group: ProcessGroup | None,
                              sequence_parallel_size: int = 1, pairs: bool = False) -> torch.Tensor:
    """`step.forward_backward` for a pipeline stage: 1F1B (`one_f_one_b`; interleaved when the stage holds several
    chunks) over the micro-batches with the model's cross-entropy as the last chunk's loss; returns the summed token
    loss on the last stage (zero elsewhere).

    Micro-batches must already be CP-sharded (`context_parallel.shard_micro_batch`); `sequence_parallel_size` is the TP
    size when sequence parallelism splits the hidden states along tokens (1 otherwise). With one stage (`pp_group`
    None) this is plain gradient accumulation, so it also serves runs without pipeline parallelism. With `pairs`
    (`parallel.ep_overlap`), micro-batches go through the schedule two at a time, interleaved
    (services/trainer/parallel/micro_batch_pairs.py).
    """
    mbs, link, stage_forward, autocast, micro_batch_forward = _loss_stage(
        model_stage, micro_batches, device, autocast_dtype, pp_group, sequence_parallel_size)
    with fp8_weights_held(model_stage, len(mbs)):
        if not pairs:
            return one_f_one_b(micro_batch_forward, link, step_tokens)
        # stage_forward binds its micro-batch's context-parallel layout when called; every switch rebinds it (when some
        # micro-batch has one)
        cp = any(mb.get("cp_layout") is not None for mb in mbs)
        rebind = (lambda i: bind_micro_batch(model_stage, mbs[i])) if cp else None
        return one_f_one_b(micro_batch_forward, link, step_tokens,
                           unit_forward=pair_forward(stage_forward, autocast, rebind), unit_size=2)


def loss_forward_pipeline(model_stage: nn.Module, micro_batches: list[dict[str, torch.Tensor]], device: torch.device,
                          autocast_dtype: torch.dtype | None, pp_group: ProcessGroup | None,
                          sequence_parallel_size: int = 1) -> torch.Tensor:
    """`forward_backward_pipeline`'s forward alone (`forward_only`, no autograd): the micro-batches' summed token loss
    on the last stage, zero elsewhere (evaluation, services/trainer/evaluate.py)."""
    mbs, link, _, _, micro_batch_forward = _loss_stage(model_stage, micro_batches, device, autocast_dtype, pp_group,
                                                       sequence_parallel_size)
    with fp8_weights_held(model_stage, len(mbs)):
        losses = forward_only(micro_batch_forward, link)
    return sum((loss.float() for loss in losses if loss is not None), torch.zeros((), device=device))


def _loss_stage(model_stage: nn.Module, micro_batches: list[dict[str, torch.Tensor]], device: torch.device,
                autocast_dtype: torch.dtype | None, pp_group: ProcessGroup | None, sequence_parallel_size: int):
    """(the micro-batches on `device`, their StageLink, the stage's forward with the model's cross-entropy as the last
    chunk's output, the autocast context, that forward under autocast) of the pre-training schedules."""
    mbs = [to_device(mb, device) for mb in micro_batches]
    link = StageLink.of(model_stage, [mb["tokens"].shape[0] for mb in mbs], device, pp_group, sequence_parallel_size)

    def stage_forward(i: int, hidden: torch.Tensor | None, chunk: int, staged: bool = False):
        mb = mbs[i]
        bind_micro_batch(model_stage, mb)
        # every chunk gets the labels: the first one embeds the MTP depths' inputs from them (model.mtp_num_layers)
        return model_stage(mb["tokens"], mb["position_ids"], mb["cu_seqlens"], mb.get("max_seqlen"), hidden=hidden,
                           labels=mb["labels"], staged=staged, layers=link.chunks[chunk],
                           mtp_labels=mb.get("mtp_labels"))

    def autocast():
        return torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)

    def micro_batch_forward(i: int, hidden: torch.Tensor | None, chunk: int) -> torch.Tensor:
        with autocast():
            return stage_forward(i, hidden, chunk)

    return mbs, link, stage_forward, autocast, micro_batch_forward
