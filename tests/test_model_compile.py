"""`model.compile`: the attention's QK-norm + RoPE run through torch.compile (fused kernels forward and backward) and
compute what the eager functions compute. On CPU, inductor generates C++ instead of Triton; the same graph is traced
either way, so this checks that the compiled region is the eager one (one compile, ~1 min on a 2-core machine)."""

from __future__ import annotations

import torch

from services.common.config import ModelConfig
from services.trainer.model.attention import compiled_head_norm_rope, head_norm_rope
from services.trainer.model.transformer import MoETransformer

CFG = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2, moe_ffn_hidden_size=24,
           qk_norm=True, rope_theta=1e4)


def loss_and_grads(model: MoETransformer):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 264, (40,), generator=gen)
    cu_seqlens = torch.tensor([0, 17, 40], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(17), torch.arange(23)])
    loss = model(tokens, position_ids, cu_seqlens, labels=torch.roll(tokens, -1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_model_matches_eager():
    eager = MoETransformer(ModelConfig(**CFG))
    eager.init_weights(0)
    compiled = MoETransformer(ModelConfig(**CFG, compile=True))
    compiled.load_state_dict(eager.state_dict())
    assert compiled.layers["0"].attn.head_norm_rope is compiled_head_norm_rope()
    assert eager.layers["0"].attn.head_norm_rope is head_norm_rope

    loss_e, grads_e = loss_and_grads(eager)
    loss_c, grads_c = loss_and_grads(compiled)
    # fp32 throughout; the fused kernels reorder the norm's sum and RoPE's products: rounding-level differences.
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    assert grads_c.keys() == grads_e.keys()
    assert any("q_norm" in n for n in grads_c)  # the QK-norm scales are trained through the compiled backward
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_function_follows_new_token_counts():
    """Packed micro-batches change their token count: the compiled function must keep matching (dynamo re-traces
    for the new shape, then stays shape-generic)."""
    fn = compiled_head_norm_rope()
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    scale_q, scale_k = torch.rand(16) + 0.5, torch.rand(16) + 0.5
    for tokens in (40, 23, 57):
        q, k = torch.randn(tokens, 4, 16), torch.randn(tokens, 2, 16)
        pos = torch.arange(tokens) % 11
        want = head_norm_rope(q, k, scale_q, scale_k, 1e-6, pos, inv_freq)
        got = fn(q, k, scale_q, scale_k, 1e-6, pos, inv_freq)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert got[0].shape == q.shape
