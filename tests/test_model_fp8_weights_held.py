"""Every place that runs one optimizer step's passes holds the FP8 experts' quantised weights across them
(services/trainer/model/moe/experts.py `fp8_weights_held`): the plain step, the pipeline schedule (which also runs
steps without pipeline stages) and the RL step, through all their micro-batches, and drops them before the optimizer
changes the weights. On CPU the experts compute in the parameters' dtype, but they hold the same way, so the tests
watch what each experts module holds when its forward starts. (That the held copies give bit-for-bit the same
result as quantising at every call: tests/test_kernels_fp8_grouped_mm.py.)"""

from __future__ import annotations

import pytest
import torch

from services.common.config import Config, RLConfig
from services.trainer.model.moe.experts import GroupedExperts
from services.trainer.model.transformer import MoETransformer
from services.trainer.parallel.pipeline import forward_backward_pipeline
from services.trainer.rl.step import rl_step
from services.trainer.step import forward_backward
from tests.rl_helpers import micro_batches, tiny_model
from tests.test_rl_step import _groups


pytestmark = pytest.mark.usefixtures("as_on_a_cpu_machine")  # CPU models with model.fp8 set (tests/conftest.py)


def _watch(model) -> tuple[list[GroupedExperts], list[bool]]:
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    held: list[bool] = []
    for m in experts:
        m.register_forward_pre_hook(lambda mod, args: held.append(mod.fp8_weights is not None))
    return experts, held


def _model(fp8: str = "tensorwise") -> MoETransformer:
    cfg = Config()
    for k, v in dict(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2, num_experts=4, top_k=2,
                     moe_ffn_hidden_size=16, moe_kernels=[], fp8=fp8).items():
        setattr(cfg.model, k, v)
    model = MoETransformer(cfg.model)
    model.init_weights(0)
    return model


def _micro_batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 32, (10,), generator=g)
        out.append({"tokens": tokens, "labels": tokens.roll(-1), "position_ids": torch.arange(10),
                    "cu_seqlens": torch.tensor([0, 10], dtype=torch.int32)})
    return out


def test_the_step_holds_them_over_several_micro_batches_and_not_over_one():
    for n, want in ((3, True), (1, False)):
        model = _model()
        experts, held = _watch(model)
        forward_backward(model, _micro_batches(n), 30, torch.device("cpu"), None)
        assert len(held) == n * len(experts) and all(h == want for h in held)
        assert all(m.fp8_weights is None for m in experts)  # dropped before the optimizer step


def test_the_pipeline_schedule_holds_them_over_its_micro_batches():
    model = _model()
    experts, held = _watch(model)
    forward_backward_pipeline(model, _micro_batches(3), 30, torch.device("cpu"), None, pp_group=None)
    assert len(held) == 3 * len(experts) and all(held)
    assert all(m.fp8_weights is None for m in experts)


def test_bf16_experts_hold_nothing():
    model = _model(fp8="")
    experts, held = _watch(model)
    forward_backward(model, _micro_batches(3), 30, torch.device("cpu"), None)
    assert held and not any(held)


def test_the_rl_step_holds_them_through_its_logprob_passes_and_its_backward_passes():
    model = tiny_model(seed=3, fp8="tensorwise")
    groups = _groups(model)  # generation, outside any step: nothing held
    experts, held = _watch(model)
    rl = RLConfig(micro_batch_tokens=12, recompute_logprobs=True)  # one sample per micro-batch: 8 of them
    (data,) = micro_batches(groups, max_tokens=rl.micro_batch_tokens)
    rl_step(model, torch.optim.SGD(model.parameters(), lr=0.01), data, rl, torch.device("cpu"), version=1).read()
    assert len(held) == 2 * 8 * len(experts) and all(held)  # a no-grad pass and a training pass per micro-batch
    assert all(m.fp8_weights is None for m in experts)
