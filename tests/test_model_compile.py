"""`model.compile`: the decoder's memory-bound glue runs through torch.compile (fused kernels forward and backward) and
computes what the eager model computes: the attention's QK-norm + RoPE, and every residual add with the RMSNorm that
reads its sum. On CPU, inductor generates C++ instead of Triton; the same graphs are traced either way, so this checks
that the compiled regions are the eager ones (a few compiles: ~1.5 min on a 2-core machine)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from parallel_harness import assert_parity, make_batches, run_parallel, run_reference, tiny_config
from services.common.config import ModelConfig
from services.trainer.model import transformer
from services.trainer.model.attention import compiled_head_norm_rope, head_norm_rope
from services.trainer.model.recompute import apply_memory_policy
from services.trainer.model.transformer import MoETransformer, add_rms_norm, compiled_add_rms_norm

# A dense first layer and a MoE one: under autocast their outputs reach the residual add in bf16 and fp32 respectively.
CFG = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2, moe_ffn_hidden_size=24,
           first_k_dense=1, ffn_hidden_size=48, qk_norm=True, rope_theta=1e4)
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}
# Every residual add meets a norm except at the first block's attn_norm, which reads the embedding alone.
FUSED = {"layers.0.mlp_norm", "layers.1.attn_norm", "layers.1.mlp_norm", "norm"}


def batch(tokens: int = 40):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, 264, (tokens,), generator=gen)
    first = tokens // 2 - 3
    cu_seqlens = torch.tensor([0, first, tokens], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(first), torch.arange(tokens - first)])
    return ids, position_ids, cu_seqlens


def loss_and_grads(model: MoETransformer, autocast: torch.dtype | None = None, tokens: int = 40):
    ids, position_ids, cu_seqlens = batch(tokens)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = model(ids, position_ids, cu_seqlens, labels=torch.roll(ids, -1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def eager_and_compiled() -> tuple[MoETransformer, MoETransformer]:
    eager = MoETransformer(ModelConfig(**CFG))
    eager.init_weights(0)
    compiled = MoETransformer(ModelConfig(**CFG, compile=True))
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def spy_fused_norms(monkeypatch, model: MoETransformer) -> set[str]:
    """The names of the norms of `model` whose residual add + norm goes through the compiled function, filled as it
    runs."""
    names = {id(p): n.removesuffix(".weight") for n, p in model.named_parameters()}
    fused: set[str] = set()
    compiled = compiled_add_rms_norm()

    def spy(x, branch, weight, eps):
        fused.add(names[id(weight)])
        return compiled(x, branch, weight, eps)

    monkeypatch.setattr(transformer, "compiled_add_rms_norm", lambda: spy)
    return fused


def compiled_graphs(fn) -> int:
    """How many compiled versions dynamo holds for the plain function `fn` (one per distinct set of guards)."""
    return len(_debug_get_cache_entry_list(fn.__code__))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12))


@pytest.mark.parametrize("autocast", ["fp32", "bf16"])
def test_compiled_model_matches_eager(autocast, monkeypatch):
    eager, compiled = eager_and_compiled()
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # norms stay modules: checkpoints unchanged
    assert compiled.layers["0"].attn.head_norm_rope is compiled_head_norm_rope()
    assert eager.layers["0"].attn.head_norm_rope is head_norm_rope
    fused = spy_fused_norms(monkeypatch, compiled)

    loss_e, grads_e = loss_and_grads(eager, AUTOCAST[autocast])
    loss_c, grads_c = loss_and_grads(compiled, AUTOCAST[autocast])
    assert fused == FUSED
    assert grads_c.keys() == grads_e.keys()
    assert any("q_norm" in n for n in grads_c)  # the QK-norm scales are trained through the compiled backward
    assert {"layers.1.attn_norm.weight", "layers.1.mlp_norm.weight", "norm.weight"} <= grads_c.keys()
    if autocast == "fp32":
        # The fused kernels reorder the norms' sums (the norm scales' gradients sum over tokens) and RoPE's products:
        # rounding-level differences.
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6, msg=name)
    else:
        # The QK-norm runs on bf16 heads: compiled, it rounds to bf16 once, from fp32, where eager rounds its steps, and
        # those bf16-ulp differences (2^-8 relative) reach every gradient through the attention.
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=0)
        for name in grads_e:
            assert relative_error(grads_c[name], grads_e[name]) < 2e-2, name


@pytest.mark.parametrize("autocast", ["fp32", "bf16"])
def test_fused_residual_norms_change_only_rounding(autocast, monkeypatch):
    """The compiled model against itself with the eager `add_rms_norm` in place of the compiled one: the residual
    stream and the norms stay fp32 under autocast too, so only the order of the norms' sums differs."""
    _, compiled = eager_and_compiled()
    loss_c, grads_c = loss_and_grads(compiled, AUTOCAST[autocast])
    monkeypatch.setattr(transformer, "compiled_add_rms_norm", lambda: add_rms_norm)
    loss_e, grads_e = loss_and_grads(compiled, AUTOCAST[autocast])
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("autocast", ["fp32", "bf16"])
def test_compiled_add_rms_norm_is_the_eager_add_and_norm(autocast):
    """The fused residual add + RMSNorm alone: both outputs and the gradients of x, the branch and the norm scale,
    with the residual stream in fp32 and the branch in the autocast dtype, as the blocks call it."""
    gen = torch.Generator().manual_seed(1)
    dtype = AUTOCAST[autocast] or torch.float32
    x = torch.randn(37, 32, generator=gen)
    branch = torch.randn(37, 32, generator=gen).to(dtype)
    weight = torch.rand(32, generator=gen) + 0.5
    grads = (torch.randn(37, 32, generator=gen), torch.randn(37, 32, generator=gen))

    def run(fn):
        inputs = [t.clone().requires_grad_(True) for t in (x, branch, weight)]
        with torch.autocast("cpu", dtype=dtype, enabled=autocast != "fp32"):
            out = fn(*inputs, 1e-6)
        torch.autograd.backward(out, grads)
        return [o.detach() for o in out], [t.grad for t in inputs]

    (out_e, grads_e), (out_c, grads_c) = run(add_rms_norm), run(compiled_add_rms_norm())
    for got, want in zip(out_c + grads_c, out_e + grads_e):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_new_token_counts_stop_compiling_after_the_second():
    """Packed micro-batches change their token count. Dynamo compiles the first count as static, the second as
    shape-generic, then nothing more for new counts; each other (autocast, branch dtype) combination adds one version.
    Each count still matches eager."""
    torch._dynamo.reset()  # count from nothing, whatever the tests before compiled
    eager, compiled = eager_and_compiled()
    counts = {}
    for autocast in ("fp32", "bf16"):
        for tokens in (40, 23, 57, 31):
            loss_e, _ = loss_and_grads(eager, AUTOCAST[autocast], tokens)
            loss_c, _ = loss_and_grads(compiled, AUTOCAST[autocast], tokens)
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-3 if autocast == "bf16" else 1e-6, atol=0)
            counts[autocast, tokens] = (compiled_graphs(add_rms_norm), compiled_graphs(head_norm_rope))
    assert [counts["fp32", t] for t in (40, 23, 57, 31)] == [(1, 1), (2, 2), (2, 2), (2, 2)]
    # Under autocast the dense layer's output reaches the add in bf16, the MoE layer's in fp32: two new versions of the
    # add + norm, already shape-generic; one of QK-norm + RoPE.
    assert [counts["bf16", t] for t in (40, 23, 57, 31)] == [(4, 3)] * 4


@pytest.mark.parametrize("recompute,offload,fused_norms", [
    (["norm"], [], {"norm"}),  # recomputed norms run their own (wrapped) forward after an eager add
    (["norm"], ["layer"], {"norm"}),
    (["layer"], [], {"layers.0.mlp_norm", "layers.1.mlp_norm", "norm"}),  # a wrapped block gets the stream summed
    (["attn_core", "moe"], ["attn"], FUSED),  # policies inside the sublayers leave every norm fused
])
def test_memory_policies_keep_the_compiled_model_exact(recompute, offload, fused_norms, monkeypatch):
    """Under a memory policy the compiled model computes what it computes without one; the fusion stays wherever the
    policy leaves the norm and its block alone."""
    _, compiled = eager_and_compiled()
    policy = apply_memory_policy(copy.deepcopy(compiled), recompute, offload)
    loss_c, grads_c = loss_and_grads(compiled)
    fused = spy_fused_norms(monkeypatch, policy)
    loss_p, grads_p = loss_and_grads(policy)
    assert fused == fused_norms
    torch.testing.assert_close(loss_p, loss_c, rtol=1e-6, atol=0)
    for name in grads_c:
        torch.testing.assert_close(grads_p[name], grads_c[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("parallel,recompute", [
    (dict(tp=2), ["norm"]),  # sequence parallelism: the norms see token shards; layer 1's norms are the policy's
    (dict(pp=2), ["layer"]),  # stages send the stream summed; the recomputed layer 1 receives it summed
    (dict(tp=2, ep=2, ep_overlap=True), []),  # the staged forward of interleaved micro-batch pairs
], ids=["tp2_sp", "pp2", "ep2_pairs"])
def test_compiled_parallel_run_matches_eager_single_process(tmp_path, parallel, recompute):
    """The parallel layouts that replace, shard or split what the blocks run, compiled, against one eager process
    (the harness's 1e-5 relative L2 on losses, gradients and parameters after two AdamW steps)."""
    cfg = tiny_config(**parallel)
    cfg.model.num_layers, cfg.model.first_k_dense, cfg.model.qk_norm = 3, 1, True
    cfg.model.recompute, cfg.model.recompute_layers = recompute, [1] if recompute else []
    cfg.data.grad_accum = 2  # micro-batches in pairs under ep_overlap
    cfg.optimizer.lr = 2e-3
    batches = make_batches(cfg.model, steps=2, micro=2, tokens=32, seed=3)
    reference = run_reference(cfg, batches)
    cfg.model.compile = True
    assert_parity(reference, run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))
