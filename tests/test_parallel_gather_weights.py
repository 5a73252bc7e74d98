"""`WeightGather` assembles, on rank 0, exactly the single-process model's state_dict from any folded layout's shards.

Each layout starts from the same `init_weights(seed)` as one process (the parallel side slices it), so the gathered
tensors must be bit-identical, name for name and in the same order: in the stored dtype (fp32) and cast to bf16 (the
cast of equal values is equal). The RL trainer's publish path (`PolicyVersions`: the gather streamed into the
publisher's host buffers) serves exactly the bf16 state to a worker. Layouts: TP2, EP2, ETP2, PP2 on two gloo ranks; TP2·EP2, EP2·ETP2, DP2·EP2 (EDP2),
PP2·TP2 and PP2·EP2 on four. The model has a dense first layer and a shared expert, so every kind of box is covered.
"""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from services.common.config import Config
from services.trainer.model.transformer import MoETransformer
from tests.parallel_harness import spawn_ranks
from tests.rl_helpers import tiny_model_config

SEED = 5
LAYOUTS = {
    2: [dict(tp=2), dict(ep=2), dict(etp=2), dict(pp=2)],
    4: [dict(tp=2, ep=2), dict(ep=2, etp=2), dict(ep=2), dict(pp=2, tp=2), dict(pp=2, ep=2)],
}


def _config(**parallel) -> Config:
    cfg = Config()
    cfg.model = tiny_model_config(num_layers=4)
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _model() -> MoETransformer:
    model = MoETransformer(_config().model)
    model.init_weights(SEED)
    with torch.no_grad():  # buffers too: a non-zero router bias proves buffers travel
        for i, m in enumerate(model.moe_layers()):
            m.router.expert_bias.copy_(torch.arange(m.router.num_experts, dtype=torch.float32) * 0.1 + i)
    return model


class _NoRegistry:
    def register(self, *_args, **_kwargs):
        return SimpleNamespace(stop=lambda: None)


def _worker(rank: int, world: int, out_dir: str) -> None:
    from services.rl_rollout.weights import WeightReceiver
    from services.trainer.parallel.gather_weights import WeightGather
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import parallelize
    from services.trainer.rl.train_rl import PolicyVersions

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    try:
        for layout in LAYOUTS[world]:
            cfg = _config(**layout)
            groups = init_groups(cfg)
            model = parallelize(_model(), cfg, groups)
            gather = WeightGather(model, groups)
            fp32 = gather.state_dict()
            bf16 = gather.state_dict(torch.bfloat16)
            policy, served = PolicyVersions(model, cfg, groups, _NoRegistry(), lead=rank == 0), None
            try:
                for version in (1, 2):  # the second into fresh buffers (the first version is still kept)
                    policy.publish(version)
                if rank == 0:
                    receiver = WeightReceiver(policy.publisher.endpoint, timeout_s=60)
                    manifest = receiver.latest()
                    assert manifest.version == 2
                    served = receiver.fetch(manifest)
                    receiver.close()
            finally:
                policy.close()
            out[str(layout)] = (fp32, bf16, served)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_gathered_weights_equal_the_single_process_state_dict_exactly(world, tmp_path):
    ranks = spawn_ranks(_worker, (world, str(tmp_path)), world, str(tmp_path))
    want = _model().state_dict()
    for layout in LAYOUTS[world]:
        fp32, bf16, served = ranks[0][str(layout)]
        assert list(fp32) == list(want), f"{layout}: names or order differ from the single-process state_dict"
        for name, t in want.items():
            assert fp32[name].dtype == t.dtype and torch.equal(fp32[name], t), f"{layout}: {name} differs"
            assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], t.to(torch.bfloat16)), \
                f"{layout}: {name} in bf16 differs"
            want_served = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert torch.equal(served[name], want_served), f"{layout}: {name} as published differs"
        assert served.keys() == want.keys()
        for r in range(1, world):
            assert ranks[r][str(layout)] == (None, None, None), f"{layout}: rank {r} received tensors"
