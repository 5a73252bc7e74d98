"""The memory report counts each category from the tensors: parameters, gradients and AdamW state are exact sizes, and
activations are what the step saved for backward (so recompute shrinks them and nothing else)."""

import torch

from services.common.config import ModelConfig
from services.trainer.memory_report import measure_step
from services.trainer.model.recompute import apply_memory_policy
from services.trainer.model.transformer import MoETransformer
from services.trainer.step import forward_backward

CFG = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2, moe_ffn_hidden_size=24,
           ffn_hidden_size=48, first_k_dense=1)


def report(recompute=(), autocast=None, micro_batches=1):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**CFG))
    model.init_weights(0)
    apply_memory_policy(model, list(recompute), [])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 264, (64,))
    mb = {"tokens": tokens, "labels": torch.roll(tokens, -1), "position_ids": torch.arange(64),
          "cu_seqlens": torch.tensor([0, 64], dtype=torch.int32), "max_seqlen": 64}

    def step():
        opt.zero_grad(set_to_none=True)
        forward_backward(model, [mb] * micro_batches, 64 * micro_batches, torch.device("cpu"), autocast)
        opt.step()

    return model, measure_step(model, opt, step, torch.device("cpu"))


def test_categories_are_the_sizes_of_the_tensors():
    model, r = report()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert r.parameters == param_bytes
    assert r.gradients == param_bytes  # every parameter got a gradient
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a scalar step each.
    assert 2 * param_bytes <= r.optimizer_state <= 2 * param_bytes + 4 * len(list(model.parameters())) * 8
    assert r.activations > 0 and r.peak is None and r.other is None
    assert "activations" in r.table()


def test_recompute_shrinks_only_the_activations():
    _, plain = report()
    _, recomputed = report(["layer"])
    assert recomputed.activations < plain.activations / 2
    assert (recomputed.parameters, recomputed.gradients, recomputed.optimizer_state) == \
        (plain.parameters, plain.gradients, plain.optimizer_state)


def test_with_several_micro_batches_the_saved_categories_are_what_backward_starts_with():
    # Backward starts after the first micro-batch's forward: its saved tensors (and casts) are what is alive then.
    # The later micro-batches' are allocated as earlier ones are freed, and are not counted again wherever they land.
    for autocast in (None, torch.bfloat16):
        _, one = report(autocast=autocast)
        _, three = report(autocast=autocast, micro_batches=3)
        assert (three.activations, three.parameter_copies) == (one.activations, one.parameter_copies)
        assert three.gradients == one.gradients


def test_bf16_casts_of_weights_are_parameter_copies_not_activations():
    """Under bf16 autocast the projections keep bf16 copies of the fp32 weights for backward: those are counted as
    parameter copies (each weight at most once, in bf16), and what is left as activations is what fp32 saves less
    the weights' storage."""
    model, fp32 = report()
    _, bf16 = report(autocast=torch.bfloat16)
    assert fp32.parameter_copies == 0  # fp32 GEMMs save the parameters themselves, which are not counted at all
    # Every projection and expert weight, once, in bf16. Not: the embedding (a gather), the router (it scores in fp32),
    # the output layer (the fused cross-entropy computes its gradients in forward and keeps no weight).
    copied = [p for name, p in model.named_parameters() if p.ndim >= 2 and not name.startswith(("embed.", "output."))
              and ".router." not in name]
    assert bf16.parameter_copies == sum(2 * p.numel() for p in copied)
    assert bf16.activations < fp32.activations  # bf16 activations, and the copies are not among them
    assert "parameter copies" in bf16.table()


def test_with_bf16_parameters_master_weights_are_optimizer_state_and_fp32_parameters_count_once():
    """`optimizer.param_dtype=bf16`: the parameters are 2 B per element (4 B for those that stay fp32), the optimizer
    holds two fp32 moments (8 B) per element and a bf16 parameter's 2 B master remainder, where an fp32 parameter's
    master is the parameter itself, counted as a parameter only; and no bf16 copies of weights are saved for
    backward."""
    from services.common.config import OptimizerConfig
    from services.trainer.optim import build_adamw, stays_fp32

    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**CFG))
    model.init_weights(0)
    opt = build_adamw(model, OptimizerConfig(param_dtype="bf16"))
    tokens = torch.randint(0, 264, (64,))
    mb = {"tokens": tokens, "labels": torch.roll(tokens, -1), "position_ids": torch.arange(64),
          "cu_seqlens": torch.tensor([0, 64], dtype=torch.int32), "max_seqlen": 64}

    def step():
        opt.zero_grad(set_to_none=True)
        forward_backward(model, [mb], 64, torch.device("cpu"), torch.bfloat16)
        opt.step()

    r = measure_step(model, opt, step, torch.device("cpu"))
    kept = sum(p.numel() for n, p in model.named_parameters() if stays_fp32(n, p))
    total = sum(p.numel() for p in model.parameters())
    assert r.parameters == 2 * (total - kept) + 4 * kept
    assert 10 * total - 2 * kept <= r.optimizer_state <= 10 * total - 2 * kept + 4 * len(list(model.parameters()))
    assert r.parameter_copies == 0


def test_fp8_experts_e4m3_weights_are_parameter_copies_not_activations():
    """The FP8 experts' linear quantises its weight inside an autograd function and keeps the e4m3 copy for dgrad:
    counted as a parameter copy (1 B per element), and the activations are only what the function saves per token."""
    from kernels.fp8_grouped_mm import fp8_grouped_linear

    E, K, N, M = 3, 64, 48, 40
    w = torch.nn.Parameter(torch.randn(E, K, N) * 0.1)
    module = torch.nn.Module()
    module.w = w
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(M, K)
    offs = torch.tensor([10, 25, M], dtype=torch.int32)

    def step():
        opt.zero_grad(set_to_none=True)
        fp8_grouped_linear(x, w, offs, "tensorwise").float().sum().backward()  # sum: saves nothing
        opt.step()

    r = measure_step(module, opt, step, torch.device("cpu"))
    assert r.parameter_copies == E * K * N
    # saved per token: x itself (fp32); plus the per-expert scales and offs, a few bytes
    assert M * K * 4 <= r.activations <= M * K * 4 + 64
