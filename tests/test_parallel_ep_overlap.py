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
from services.trainer.parallel.groups import Axis


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield Axis("ep_etp", dist.group.WORLD, (0,), 0)
    finally:
        dist.destroy_process_group()


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

    def recording(*args, async_op: bool = False, **kwargs):
        work = synchronous(*args, async_op=async_op, **kwargs)
        if not async_op:
            return work
        events.append("launch")

        class Recorded:
            def wait(self):
                events.append("wait")
                return work.wait()

        return Recorded()

    monkeypatch.setattr(dist, "all_to_all_single", recording)
    layer.shared_expert.register_forward_hook(lambda *_: events.append("shared"))
    layer.shared_expert.register_full_backward_hook(lambda *_: events.append("shared"))

    x = torch.randn(10, 16, requires_grad=True)
    out = layer(x)
    assert events == ["launch", "launch", "shared", "wait", "wait"]  # tokens and their router weights
    events.clear()
    out.square().sum().backward()
    assert events == ["launch", "launch", "shared", "wait", "wait"]  # the gradients' transfers, the other way
    assert x.grad is not None and layer.shared_expert.down_proj.weight.grad is not None

    # The split transfer computes what the plain layer does.
    monkeypatch.setattr(dist, "all_to_all_single", synchronous)
    plain = MoELayer(cfg)
    plain.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_()
    plain(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)  # local dispatch sums in another order
