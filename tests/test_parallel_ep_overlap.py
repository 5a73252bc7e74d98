"""The shared expert runs while the all-to-all dispatch of the routed tokens is in flight, in forward and in backward
(issue #8: shared experts computed while the dispatch is in flight). The all-to-all is split in two autograd nodes
(`_Launch`, `_Land` in services/trainer/parallel/expert_parallel.py); this test records, on a one-rank gloo group, the
order in which transfers are launched and waited for and the shared expert runs. Correctness under real EP (the
same losses and gradients as one process, shared expert included) is tests/test_parallel_folded.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from services.common.config import ModelConfig
from services.trainer.model.moe.moe_layer import MoELayer
from services.trainer.parallel.expert_parallel import AllToAllDispatcher


def recording_all_to_all(events: list[str], synchronous, counts: bool = False):
    """`dist.all_to_all_single` that records "launch" and "wait" of each asynchronous transfer of rows (tokens, router
    weights, expert outputs, gradients); with `counts`, the per-expert counts exchanges as "counts" / "counts wait"."""

    def recording(out, inp, *args, async_op: bool = False, **kwargs):
        work = synchronous(out, inp, *args, async_op=async_op, **kwargs)
        is_counts = inp.dtype == torch.int64
        if not async_op or (is_counts and not counts):
            return work
        tag = "counts" if is_counts else "launch"
        events.append(tag)

        class Recorded:
            def wait(self):
                events.append("counts wait" if is_counts else "wait")
                return work.wait()

        return Recorded()

    return recording


def test_the_shared_expert_overlaps_the_dispatch_all_to_all_in_forward_and_backward(one_rank_group, monkeypatch):
    cfg = ModelConfig(hidden_size=16, num_experts=4, top_k=2, moe_ffn_hidden_size=12, shared_expert_ffn_hidden_size=8,
                      moe_kernels=[])
    layer = MoELayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    layer.dispatcher = AllToAllDispatcher(cfg.num_experts, one_rank_group, ep=1, etp=1)

    events: list[str] = []
    synchronous = dist.all_to_all_single
    monkeypatch.setattr(dist, "all_to_all_single", recording_all_to_all(events, synchronous))
    layer.shared_expert.register_forward_hook(lambda *_: events.append("shared"))
    layer.shared_expert.register_full_backward_hook(lambda *_: events.append("shared"))

    x = torch.randn(10, 16, requires_grad=True)
    out = layer(x)
    # tokens and their router weights around the shared expert; then the expert outputs' way back
    assert events == ["launch", "launch", "shared", "wait", "wait", "launch", "wait"]
    events.clear()
    out.square().sum().backward()
    # the gradients' transfers, the other way: the outputs' first, then the dispatch's around the shared expert
    assert events == ["launch", "wait", "launch", "launch", "shared", "wait", "wait"]
    assert x.grad is not None and layer.shared_expert.down_proj.weight.grad is not None

    # The split transfer computes what the plain layer does.
    monkeypatch.setattr(dist, "all_to_all_single", synchronous)
    plain = MoELayer(cfg)
    plain.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_()
    plain(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)  # local dispatch sums in another order


def test_paired_micro_batches_interleave_their_transfers_with_each_others_compute(one_rank_group, monkeypatch):
    """`parallel.ep_overlap`: micro-batch a's tokens travel while b's attention and router run, b's while a's experts
    run, and so on (services/trainer/parallel/micro_batch_pairs.py); backward mirrors it. Recorded per transfer:
    which micro-batch launched it and when it was waited for, against the experts' compute."""
    from services.common.config import Config
    from services.trainer.model.transformer import MoETransformer
    from services.trainer.parallel.pipeline import forward_backward_pipeline

    cfg = Config()
    for k, v in dict(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, num_experts=4,
                     top_k=2, moe_ffn_hidden_size=12, moe_kernels=[]).items():
        setattr(cfg.model, k, v)
    model = MoETransformer(cfg.model)
    model.init_weights(0)
    layer = model.moe_layers()[0]
    layer.dispatcher = AllToAllDispatcher(cfg.model.num_experts, one_rank_group, ep=1, etp=1)

    events: list[str] = []
    monkeypatch.setattr(dist, "all_to_all_single", recording_all_to_all(events, dist.all_to_all_single, counts=True))
    sizes = iter([10, 6])  # the two micro-batches have different token counts, so the experts' calls tell them apart
    layer.experts.register_forward_hook(lambda m, args, out: events.append(f"experts{args[0].shape[0]}"))
    layer.experts.register_full_backward_hook(lambda m, gin, gout: events.append(f"experts{gout[0].shape[0]}"))
    mbs = []
    for n in (next(sizes), next(sizes)):
        tokens = torch.randint(0, 32, (n,))
        mbs.append({"tokens": tokens, "labels": tokens.roll(-1), "position_ids": torch.arange(n),
                    "cu_seqlens": torch.tensor([0, n], dtype=torch.int32)})
    forward_backward_pipeline(model, mbs, 16, torch.device("cpu"), None, pp_group=None, pairs=True)

    a, b = "experts20", "experts12"  # 10 and 6 tokens, top-2
    forward = events[:events.index(b) + 3]
    # Both micro-batches' counts exchanges are in flight before either host waits for its counts (so the GPU has b's
    # work queued while the host waits for a's); a's tokens and router weights are in flight while b's counts are
    # awaited and b's tokens leave; a's experts run while b's tokens travel; a's outputs leave before b's experts run;
    # b's outputs leave before a's are waited for.
    assert forward == ["counts", "counts", "counts wait", "launch", "launch", "counts wait", "launch", "launch",
                       "wait", "wait", a, "launch", "wait", "wait", b, "launch", "wait"], events
    backward = events[len(forward) + 1:]
    # Each expert backward runs between the other micro-batch's gradient transfer launch and wait.
    assert backward.count(a) == 1 and backward.count(b) == 1, events
    first, second = sorted((backward.index(a), backward.index(b)))
    assert "launch" in backward[:first] and "wait" in backward[first + 1:second + 1], events
