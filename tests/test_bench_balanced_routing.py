"""bench_parallel_step's `--balanced-routing`: every expert gets the same load, whatever the router's scores say."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_parallel_step import balanced_ids  # noqa: E402
from services.common.config import Config  # noqa: E402
from services.trainer.model.moe.router import Router, expert_counts  # noqa: E402


def test_balanced_routing_gives_every_expert_the_same_load_and_distinct_experts_per_token():
    cfg = Config().model
    cfg.hidden_size, cfg.num_experts, cfg.top_k = 16, 8, 2
    router = Router(cfg)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[3] = 1.0  # scores that send every token to expert 3 first
    router.register_forward_pre_hook(balanced_ids)
    x = torch.randn(40, 16).abs()
    routing = router(x)
    assert expert_counts(routing.expert_ids, 8).tolist() == [10] * 8  # 40 tokens x 2 slots over 8 experts
    assert (routing.expert_ids[:, 0] != routing.expert_ids[:, 1]).all()
