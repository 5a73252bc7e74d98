"""The MoE layer against a plain per-token reference: loop over tokens and their top-k experts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from services.common.config import ModelConfig
from services.trainer.model.moe.moe_layer import MoELayer
from services.trainer.model.moe.router import capacity_mask, limit_to_top_groups, load_balancing_loss, z_loss


def make_layer(**overrides) -> MoELayer:
    fields = {"hidden_size": 16, "num_experts": 6, "top_k": 2, "moe_ffn_hidden_size": 12, "aux_loss_coeff": 0.0}
    cfg = ModelConfig(**{**fields, **overrides})
    layer = MoELayer(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer.double()


def reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score every expert, take top-k (with the bias for selection), weight, apply capacity, sum."""
    cfg, r = layer.router.cfg, layer.router
    logits = x.float() @ r.weight.float().T  # the router scores in fp32 by design
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    sel = scores.detach() + r.expert_bias
    if cfg.num_groups:
        sel = limit_to_top_groups(sel, cfg.num_groups, cfg.topk_groups)
    ids = sel.topk(cfg.top_k, dim=-1).indices
    T = x.shape[0]
    # capacity: each expert keeps its `cap` highest-scoring tokens
    keep = torch.ones(T, cfg.top_k, dtype=torch.bool)
    if cfg.capacity_factor > 0:
        cap = math.ceil(cfg.capacity_factor * T * cfg.top_k / cfg.num_experts)
        for e in range(cfg.num_experts):
            chosen = [(float(scores[t, e].detach()), t) for t in range(T) if e in ids[t].tolist()]
            winners = {t for _, t in sorted(chosen, key=lambda c: -c[0])[:cap]}
            for t in range(T):
                for j in range(cfg.top_k):
                    if ids[t, j] == e and t not in winners:
                        keep[t, j] = False
    out = []
    for t in range(T):
        w = scores[t, ids[t]]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        w = (w * cfg.routed_scaling_factor).to(x.dtype)
        y = torch.zeros_like(x[t])
        for j in range(cfg.top_k):
            if not keep[t, j]:
                continue
            e = int(ids[t, j])
            gate, up = (x[t] @ layer.experts.w13[e]).chunk(2)
            y = y + w[j] * ((F.silu(gate) * up) @ layer.experts.w2[e])
        if layer.shared_expert is not None:
            y = y + layer.shared_expert(x[t:t + 1])[0]
        out.append(y)
    return torch.stack(out)


CASES = {
    "softmax": {},
    "sigmoid": {"score_func": "sigmoid"},
    "softmax_no_norm": {"norm_topk_prob": False},
    "shared_expert": {"shared_expert_ffn_hidden_size": 8},
    "sigmoid_groups_shared": {"score_func": "sigmoid", "num_groups": 3, "topk_groups": 2,
                              "shared_expert_ffn_hidden_size": 8, "routed_scaling_factor": 2.5},
    "capacity_drops": {"capacity_factor": 0.5},
    "capacity_drops_shared": {"capacity_factor": 0.5, "shared_expert_ffn_hidden_size": 8},
}


@pytest.mark.parametrize("case", CASES)
def test_moe_layer_equals_per_token_reference_forward_and_gradients(case):
    layer = make_layer(**CASES[case])
    layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, 6))
    x = torch.randn(13, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(13, 16, dtype=torch.float64)
    out = layer(x)
    (out * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    gx = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    ref = reference(layer, x)
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx, x.grad, rtol=1e-10, atol=1e-10)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-10, msg=f"gradient of {n}")


def test_dropped_tokens_contribute_only_the_shared_path():
    layer = make_layer(capacity_factor=0.01, top_k=1, shared_expert_ffn_hidden_size=8)  # capacity 1 per expert
    x = torch.randn(20, 16, dtype=torch.float64)
    routing = layer.router(x)
    dropped_tokens = (~routing.kept).all(-1)
    assert dropped_tokens.sum() >= 20 - 6
    out = layer(x)
    torch.testing.assert_close(out[dropped_tokens], layer.shared_expert(x[dropped_tokens]))


def test_aux_loss_matches_its_formula_on_a_hand_computed_case():
    # 4 tokens, 2 experts, top-1: tokens 0,1,2 -> expert 0, token 3 -> expert 1.
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]], dtype=torch.float64)
    ids = torch.tensor([[0], [0], [0], [1]])
    # f = [3/4, 1/4]; P = [0.65, 0.35]; E * sum(f*P) = 2 * (0.4875 + 0.0875) = 1.15
    assert load_balancing_loss(probs, ids, 2).item() == pytest.approx(1.15)
    # per sequence: seq A = tokens 0,1 (f=[1,0], P=[.85,.15]) -> 1.7; seq B = tokens 2,3 (f=[.5,.5], P=[.45,.55]) -> 1.0
    seg = torch.tensor([0, 0, 1, 1])
    assert load_balancing_loss(probs, ids, 2, seg).item() == pytest.approx((1.7 + 1.0) / 2)
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]], dtype=torch.float64)
    expected = (math.log(2) ** 2 + math.log(math.e + math.exp(-1)) ** 2) / 2
    assert z_loss(logits).item() == pytest.approx(expected)


def test_aux_loss_gradient_reaches_the_router_through_the_layer_output():
    layer = make_layer(aux_loss_coeff=1.0)
    layer.train()
    # Seeded: with a perfectly balanced routing (equal f_e) the aux loss's gradient is exactly zero (sum of P_e is 1).
    x = torch.randn(9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(layer.router(x).expert_ids.reshape(-1), minlength=6)
    assert counts.max() > counts.min()  # an imbalanced routing, so the aux loss has a gradient
    layer(x).sum().backward()
    with_aux = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.router.cfg.aux_loss_coeff = 0.0
    layer(x).sum().backward()
    assert not torch.allclose(with_aux, layer.router.weight.grad)


@pytest.mark.parametrize("aux_loss_type", ["micro_batch", "sequence", "global"])
def test_router_padding_rows_add_nothing_to_the_load_or_the_aux_and_z_losses(aux_loss_type):
    """Rows named by `Router.padding` (an RL micro-batch padded for SP/CP, with a document of its own) leave the load,
    the aux loss, the z-loss and their gradient those of the real tokens alone, wherever the padding rows are."""
    router = make_layer(aux_loss_coeff=1.0, z_loss_coeff=0.5, aux_loss_type=aux_loss_type).router.train()
    gen = torch.Generator().manual_seed(2)
    x, seg = torch.randn(9, 16, dtype=torch.float64, generator=gen), torch.tensor([0] * 5 + [1] * 4)
    order = torch.randperm(12, generator=gen)  # the 3 padding rows (9, 10, 11) land among the tokens
    padded_x = torch.cat([x, torch.randn(3, 16, dtype=torch.float64, generator=gen)])[order]
    padded_seg, padding = torch.cat([seg, torch.full((3,), 2)])[order], order >= 9

    def route(x, seg, padding):
        router.zero_grad()
        router.tokens_per_expert.zero_()
        router.reset_step_statistics()
        router.padding = padding
        try:
            aux = router(x, seg).aux_loss
        finally:
            router.padding = None
        aux.backward()
        return aux.detach(), router.weight.grad.clone(), router.tokens_per_expert.clone()

    real, padded = route(x, seg, None), route(padded_x, padded_seg, padding)
    for got, want in zip(padded, real, strict=True):
        torch.testing.assert_close(got, want)
    assert real[0] > 0 and real[2].sum() == 9 * router.top_k


def test_capacity_keeps_the_highest_scoring_tokens_per_expert():
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.4, 0.6]])
    ids = torch.tensor([[0], [0], [0], [1]])
    kept = capacity_mask(scores, ids, capacity_factor=1.0)  # capacity ceil(4*1/2) = 2
    assert kept.squeeze(1).tolist() == [True, True, False, True]


def test_aux_free_bias_moves_load_toward_balance_on_skewed_input():
    layer = make_layer(score_func="sigmoid", top_k=1).float()
    torch.manual_seed(0)
    x = torch.randn(512, 16) + 2.0 * layer.router.weight[0].detach()  # every token prefers expert 0
    def imbalance():
        layer.router.tokens_per_expert.zero_()
        layer.router(x)
        counts = layer.router.tokens_per_expert
        return float(counts.max() / counts.mean())
    before = imbalance()
    for _ in range(300):
        layer.router.tokens_per_expert.zero_()
        layer.router(x)
        layer.router.update_bias(layer.router.tokens_per_expert.clone(), rate=0.02)
    after = imbalance()
    assert before > 3.0
    assert after < before / 2


def test_router_scores_in_fp32_under_bf16_autocast():
    """Routing is decided by small logit differences: autocast must not run the router's projection in bf16."""
    layer = make_layer().float()
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    want = layer.router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer.router(x)
    assert torch.equal(got.expert_ids, want.expert_ids)
    torch.testing.assert_close(got.weights, want.weights, rtol=0, atol=0)
