"""Pipeline parallelism: layers split into stages, and the 1F1B schedule that runs a step's micro-batches through them.

A stage is the model itself with the modules it does not own removed (the embedding lives on the first stage; the final
norm, output layer and loss on the last), so parameter names stay the single-device ones and checkpoints need no
renaming. Between stages travel hidden states [T_local, h] (T_local / tp with sequence parallelism) forward and their
gradients backward; both sides know the shape from the micro-batch's token count, so no shapes are exchanged.

MoE aux losses need no plumbing: each MoE layer attaches its aux-loss gradient to its output (`AttachAuxLoss`), so the
backward of a stage started from the received activation gradient also back-propagates that stage's aux losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from services.trainer.parallel.context_parallel import bind_micro_batch
from services.trainer.parallel.differentiable import group_rank, group_size
from services.trainer.step import to_device

ProcessGroup = dist.ProcessGroup


def stage_layers(num_layers: int, pp_size: int, pp_layers: list[int] | None = None) -> list[range]:
    """Layer ids of each stage: `pp_layers` counts per stage, or as even as possible (earlier stages take the extra)."""
    if pp_layers:
        if len(pp_layers) != pp_size or sum(pp_layers) != num_layers or min(pp_layers) < 1:
            raise ValueError(f"`parallel.pp_layers={pp_layers}` must have pp={pp_size} positive entries summing to "
                             f"num_layers={num_layers}")
        counts = list(pp_layers)
    else:
        if pp_size > num_layers:
            raise ValueError(f"`parallel.pp={pp_size}` exceeds `model.num_layers={num_layers}`")
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (s < extra) for s in range(pp_size)]
    starts = [sum(counts[:s]) for s in range(pp_size)]
    return [range(starts[s], starts[s] + counts[s]) for s in range(pp_size)]


def apply_pipeline(model: nn.Module, pp_group: ProcessGroup | None, pp_layers: list[int] | None = None) -> nn.Module:
    """Reduce `model` (in place) to this rank's stage; before tensor parallelism, so only owned modules get sharded."""
    size, rank = group_size(pp_group), group_rank(pp_group)
    if size == 1:
        return model
    owned = stage_layers(len(model.layers), size, pp_layers)[rank]
    for layer_id in list(model.layers.keys()):
        if int(layer_id) not in owned:
            del model.layers[layer_id]
    if rank != 0:
        model.embed = None
    if rank != size - 1:
        model.norm = None
        model.output = None
    return model


# ---------------------------------------------------------------- point-to-point


@dataclass
class _Peers:
    group: ProcessGroup | None  # None: a single stage
    rank: int
    size: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


def _exchange(peers: _Peers, send: list[tuple[torch.Tensor, int]], recv: list[tuple[torch.Tensor, int]]) -> None:
    """Post every send and receive of one schedule slot together, then wait: neighbours that both send before they
    receive cannot deadlock."""
    ops = [dist.P2POp(dist.isend, t, group=peers.group, group_peer=peers.rank + d) for t, d in send]
    ops += [dist.P2POp(dist.irecv, t, group=peers.group, group_peer=peers.rank + d) for t, d in recv]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# ---------------------------------------------------------------- the 1F1B schedule


class _StageRunner:
    """Forward/backward of one micro-batch on this stage, keeping what backward needs until it runs."""

    def __init__(self, model, micro_batches, step_tokens, device, autocast_dtype, peers, token_divisor):
        self.model, self.mbs, self.step_tokens = model, micro_batches, step_tokens
        self.device, self.autocast_dtype, self.peers = device, autocast_dtype, peers
        self.token_divisor = token_divisor
        self.dtype = next(model.parameters()).dtype
        self.hidden_size = next(b for b in model.layers.values()).attn_norm.weight.shape[0]
        self.inputs: dict[int, torch.Tensor | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.loss = torch.zeros((), device=device)

    def hidden_buffer(self, i: int) -> torch.Tensor:
        tokens = self.mbs[i]["tokens"].shape[0]
        if tokens % self.token_divisor:
            raise ValueError(f"micro-batch {i} has {tokens} tokens, not divisible by the sequence-parallel size "
                             f"{self.token_divisor}")
        return torch.empty(tokens // self.token_divisor, self.hidden_size, dtype=self.dtype, device=self.device)

    def forward(self, i: int, hidden: torch.Tensor | None) -> torch.Tensor | None:
        mb = self.mbs[i]
        if hidden is not None:
            hidden.requires_grad_(True)
        bind_micro_batch(self.model, mb)
        labels = mb["labels"] if self.peers.last else None
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.model(mb["tokens"], mb["position_ids"], mb["cu_seqlens"], mb.get("max_seqlen"), hidden=hidden,
                             labels=labels)
        self.inputs[i] = hidden
        if self.peers.last:
            loss_sum = out
            self.loss += loss_sum.detach()
            self.outputs[i] = loss_sum / self.step_tokens
            return None
        self.outputs[i] = out
        return out.detach().contiguous()

    def backward(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        out, hidden = self.outputs.pop(i), self.inputs.pop(i)
        torch.autograd.backward(out, grad_tensors=grad)
        return None if hidden is None else hidden.grad


def forward_backward_pipeline(model_stage: nn.Module, micro_batches: list[dict[str, torch.Tensor]], step_tokens: int,
                              device: torch.device, autocast_dtype: torch.dtype | None, pp_group: ProcessGroup | None,
                              sequence_parallel_size: int = 1) -> torch.Tensor:
    """`step.forward_backward` for a pipeline stage: 1F1B over the micro-batches; returns the summed token loss on the
    last stage (zero elsewhere).

    Stage s runs min(P-1-s, M) warm-up forwards, then alternates one forward with one backward, then drains the
    backwards: at most P-s micro-batches' activations are alive on stage s, instead of M with all-forward-then-backward.
    Micro-batches must already be CP-sharded (`context_parallel.shard_micro_batch`); `sequence_parallel_size` is the TP
    size when sequence parallelism splits the hidden states along tokens (1 otherwise). With one stage (`pp_group`
    None) this is plain gradient accumulation, so it also serves runs without pipeline parallelism.
    """
    peers = _Peers(pp_group, group_rank(pp_group), group_size(pp_group))
    mbs = [to_device(mb, device) for mb in micro_batches]
    run = _StageRunner(model_stage, mbs, step_tokens, device, autocast_dtype, peers, sequence_parallel_size)
    M = len(mbs)
    warmup = min(peers.size - 1 - peers.rank, M)

    def recv_forward(i):
        if peers.first:
            return None
        buf = run.hidden_buffer(i)
        _exchange(peers, [], [(buf, -1)])
        return buf

    def send_forward(out):
        if not peers.last:
            _exchange(peers, [(out, +1)], [])

    def recv_backward(i):
        if peers.last:
            return None
        buf = run.hidden_buffer(i)
        _exchange(peers, [], [(buf, +1)])
        return buf

    def send_backward(grad):
        if not peers.first:
            _exchange(peers, [(grad, -1)], [])

    def send_forward_recv_backward(out, i):
        if peers.last:
            return None
        buf = run.hidden_buffer(i)
        _exchange(peers, [(out, +1)], [(buf, +1)])
        return buf

    def send_backward_recv_forward(grad, i):
        if peers.first:
            return None
        buf = run.hidden_buffer(i)
        _exchange(peers, [(grad, -1)], [(buf, -1)])
        return buf

    for i in range(warmup):
        send_forward(run.forward(i, recv_forward(i)))
    steady = M - warmup
    hidden = recv_forward(warmup) if steady else None
    for j in range(steady):
        fwd, bwd = warmup + j, j
        out = run.forward(fwd, hidden)
        grad = send_forward_recv_backward(out, bwd)
        grad_in = run.backward(bwd, grad)
        if j == steady - 1:
            send_backward(grad_in)
        else:
            hidden = send_backward_recv_forward(grad_in, fwd + 1)
    for bwd in range(steady, M):
        send_backward(run.backward(bwd, recv_backward(bwd)))
    return run.loss
