"""Multi-head Latent Attention (`model.attention=mla`, services/trainer/model/mla.py) and YaRN RoPE scaling
(services/trainer/model/rope.py) compute what transformers computes.

Specification:
- YaRN's frequencies and its cos/sin factor are transformers' `ROPE_INIT_FUNCTIONS["yarn"]` bit for bit.
- An MLA layer, loaded with a transformers DeepseekV3Attention's state_dict as it is (same names, non-interleaved RoPE),
  gives that module's output on every document of a packed batch, with q_lora_rank 0 and > 0 and with YaRN (DeepSeek's
  softmax-scale correction included); a GQA layer with YaRN gives transformers' LlamaAttention's. fp32: 1e-5.
- The model's memory policies (recompute "attn_core", "norm", "layer"; offload "attn"), `model.compile` and
  `model.fp8` (a no-op on CPU) leave an MLA model's loss and gradients as they are; "attn_core" wraps the MLA core.
- The config refuses what MLA cannot mean, naming the keys.
- On CUDA: the varlen flash-attention core, whose kernels take one head dim for q, k and v, gives for MLA's narrower
  (or wider) values what the masked SDPA reference gives, forward and backward, in bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.common.config import ConfigError, ModelConfig, load_config
from services.trainer.model.attention import Attention, packed_causal_attention
from services.trainer.model.mla import MLAttention
from services.trainer.model.recompute import apply_memory_policy
from services.trainer.model.rope import yarn_frequencies, yarn_rotary_scale
from services.trainer.model.transformer import MoETransformer

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

YARN = dict(rope_scaling_factor=8.0, rope_original_max_position=16, rope_beta_fast=32.0, rope_beta_slow=1.0,
            rope_mscale=1.0, rope_mscale_all_dim=0.5)
MLA = dict(attention="mla", kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6)
LENGTHS = [9, 14, 5]


def hf_rope_parameters(cfg: ModelConfig) -> dict:
    if cfg.rope_scaling_factor == 1:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position, "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}


@pytest.mark.parametrize("dim, factor, mscale, mscale_all_dim, beta_fast, beta_slow, original", [
    (64, 40.0, 1.0, 1.0, 32.0, 1.0, 4096),  # DeepSeek-V3
    (8, 4.0, 0.707, 0.0, 32.0, 1.0, 256),
    (128, 8.0, 1.0, 0.5, 16.0, 2.0, 2048),
    (16, 2.0, 0.0, 1.0, 32.0, 1.0, 4096),  # mscale 0: transformers falls back to mscale(factor)
])
def test_yarn_frequencies_and_rotary_scale_are_transformers_yarn(dim, factor, mscale, mscale_all_dim, beta_fast,
                                                                 beta_slow, original):
    cfg = ModelConfig(rope_theta=10000.0, rope_scaling_factor=factor, rope_original_max_position=original,
                      rope_beta_fast=beta_fast, rope_beta_slow=beta_slow, rope_mscale=mscale,
                      rope_mscale_all_dim=mscale_all_dim)
    hf = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=dim,
                                       max_position_embeddings=int(original * factor),
                                       rope_parameters=hf_rope_parameters(cfg))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(yarn_frequencies(dim, cfg), inv_freq)
    assert yarn_rotary_scale(cfg) == pytest.approx(attention_factor, rel=1e-12)


def packed_input(hidden: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(LENGTHS), hidden, generator=gen)
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])
    return x, position_ids, cu


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random, norm scales around 1: a norm left at ones would hide a missing or misplaced norm."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if p.ndim == 1 else
                    torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return module


def hf_per_document(hf_attn, rotary, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """transformers' attention run on each document alone (batch 1, causal mask), concatenated."""
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = b - a
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        outs.append(hf_attn(x[None, a:b], rotary(x[None, a:b], pos), mask)[0][0])
    return torch.cat(outs)


@pytest.mark.parametrize("q_lora_rank", [0, 16], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_mla_layer_is_transformers_deepseek_v3_attention_with_its_state_dict(q_lora_rank, yarn):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cfg = ModelConfig(hidden_size=32, num_heads=4, q_lora_rank=q_lora_rank, **MLA, **(YARN if yarn else {}))
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank or None,
        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6, rope_interleave=False,
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=128, rope_parameters=hf_rope_parameters(cfg))
    hf_cfg._attn_implementation = "eager"
    hf = randomized(ds.DeepseekV3Attention(hf_cfg, layer_idx=0), seed=1).eval()
    ours = MLAttention(cfg)
    ours.load_state_dict(hf.state_dict())  # strict: the same names and shapes
    x, position_ids, cu = packed_input(32)
    with torch.no_grad():
        want = hf_per_document(hf, ds.DeepseekV3RotaryEmbedding(hf_cfg), x, cu)
        got = ours(x, position_ids, cu)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gqa_layer_with_yarn_is_transformers_llama_attention():
    from transformers.models.llama import modeling_llama as llama

    cfg = ModelConfig(hidden_size=32, num_heads=4, num_kv_heads=2, **{**YARN, "rope_mscale_all_dim": 0.0})
    hf_cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, rope_parameters=hf_rope_parameters(cfg))
    hf_cfg._attn_implementation = "eager"
    hf = randomized(llama.LlamaAttention(hf_cfg, layer_idx=0), seed=2).eval()
    ours = Attention(cfg)
    ours.load_state_dict(hf.state_dict())
    x, position_ids, cu = packed_input(32, seed=1)
    with torch.no_grad():
        want = hf_per_document(hf, llama.LlamaRotaryEmbedding(hf_cfg), x, cu)
        got = ours(x, position_ids, cu)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the model's options on an MLA model

MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2, moe_ffn_hidden_size=16,
             first_k_dense=1, ffn_hidden_size=48, q_lora_rank=16, **MLA, **YARN)


def step(model: MoETransformer):
    """(loss, gradients by name, bytes of distinct storages saved for backward) of one forward + backward."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (sum(LENGTHS),), generator=gen)
    _, position_ids, cu = packed_input(1)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, position_ids, cu, labels=torch.roll(tokens, -1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(saved.values())


def mla_model(**overrides) -> MoETransformer:
    model = MoETransformer(ModelConfig(**{**MODEL, **overrides}))
    model.init_weights(0)
    return model


def assert_same_step(got, want, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=rtol, atol=atol, msg=f"gradient of {name}")


@pytest.mark.parametrize("recompute, offload", [(["attn_core"], []), (["norm"], []), (["layer"], []), ([], ["attn"])])
def test_memory_policies_keep_an_mla_models_gradients_and_shrink_what_it_saves(recompute, offload):
    plain = mla_model()
    policy = apply_memory_policy(copy.deepcopy(plain), recompute, offload)
    if recompute == ["attn_core"]:
        assert all(block.attn.core is not plain.layers[i].attn.core for i, block in policy.layers.items())
    want, got = step(plain), step(policy)
    assert_same_step(got, want)
    assert got[2] < want[2], f"{recompute or offload}: saved {got[2]} bytes, plain model {want[2]}"


def test_compiled_mla_model_matches_eager():
    eager = mla_model()
    compiled = MoETransformer(ModelConfig(**MODEL, compile=True))
    compiled.load_state_dict(eager.state_dict())
    assert_same_step(step(compiled), step(eager), rtol=1e-5, atol=1e-6)  # fused kernels sum in another order


def test_fp8_on_cpu_leaves_an_mla_model_on_the_plain_linears(monkeypatch):
    # A CPU-only machine, also where the test runs on a GPU machine (whose build would ask for Transformer Engine).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_same_step(step(mla_model(fp8="tensorwise")), step(mla_model()), rtol=0, atol=0)


def test_attention_to_the_cached_latent_equals_attention_over_the_expanded_keys_and_values():
    """What the rollout cache decodes with (kv_b_proj absorbed, mla.py `attend_latent`) is the packed core's result:
    every token of a document, as a query against the latents of the tokens up to it."""
    attn = randomized(MLAttention(ModelConfig(hidden_size=32, num_heads=4, q_lora_rank=16, **MLA, **YARN)), seed=5)
    n = LENGTHS[1]
    x, _, _ = packed_input(32)
    q, latent, k_rope = attn.query_and_latent(x[:n], torch.arange(n))
    want = packed_causal_attention(q, *attn.expand(latent, k_rope), torch.tensor([0, n], dtype=torch.int32))
    slot, pos = torch.zeros(n, dtype=torch.int64), torch.arange(n)  # query t sees tokens 0..t of the one slot
    got = attn.attend_latent(q, latent[None], k_rope[None], slot, pos, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float32], ids=["bf16_model", "fp32_model"])
def test_attention_to_a_bf16_latent_cache_keeps_bf16_accuracy(weights):
    """A bf16 cache is read as it is (products accumulated in fp32, fp32 softmax), with bf16 or fp32 weights: the result
    is the fp32 computation's to bf16 accuracy."""
    attn = randomized(MLAttention(ModelConfig(hidden_size=32, num_heads=4, q_lora_rank=16, **MLA, **YARN)), seed=6)
    n = LENGTHS[1]
    x, _, _ = packed_input(32)
    q, latent, k_rope = attn.query_and_latent(x[:n], torch.arange(n))
    where = (torch.zeros(n, dtype=torch.int64), torch.arange(n), n)  # slot, positions, span
    cached = (latent[None], k_rope[None])
    want = attn.attend_latent(q, *cached, *where)
    low = copy.deepcopy(attn).to(weights)
    got = low.attend_latent(q.to(weights), *(t.bfloat16() for t in cached), *where)
    assert got.dtype == weights
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_mla_model_has_hf_deepseek_v3_attention_names_and_no_gqa_projections():
    names = {n for n, _ in mla_model().named_parameters() if n.startswith("layers.0.attn.")}
    assert names == {f"layers.0.attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj",
                                                           "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                                           "o_proj")}
    direct = {n for n, _ in mla_model(q_lora_rank=0).named_parameters() if n.startswith("layers.0.attn.q")}
    assert direct == {"layers.0.attn.q_proj.weight"}


# ---------------------------------------------------------------- config

MLA_OVERRIDES = ["model.attention=mla", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
                 "model.qk_rope_head_dim=8", "model.v_head_dim=8"]


@pytest.mark.parametrize("overrides, message", [
    (["model.attention=mla"], r"`model.attention=mla` needs `model.kv_lora_rank`, `model.qk_nope_head_dim`, "
                              r"`model.qk_rope_head_dim`, `model.v_head_dim` > 0"),
    (MLA_OVERRIDES[:1] + MLA_OVERRIDES[2:], r"needs `model.kv_lora_rank` > 0"),
    (["model.kv_lora_rank=16", "model.q_lora_rank=8"], r"`model.q_lora_rank`, `model.kv_lora_rank`: Multi-head "
                                                       r"Latent Attention dims, but `model.attention=gqa`"),
    (MLA_OVERRIDES + ["model.qk_norm=true"], r"`model.qk_norm` .* drop qk_norm"),
    (MLA_OVERRIDES + ["model.qk_rope_head_dim=5"], r"`model.qk_rope_head_dim=5` must be even"),
    (MLA_OVERRIDES + ["parallel.tp=3"], r"`parallel.tp=3` does not divide `model.num_heads=4`"),
    (["model.rope_scaling_factor=0.5"], r"`model.rope_scaling_factor=0.5` must be >= 1"),
    (["model.rope_scaling_factor=4", "model.rope_original_max_position=0"], r"rope_original_max_position=0"),
    (MLA_OVERRIDES + ["model.fp8=tensorwise", "model.hidden_size=64", "model.moe_ffn_hidden_size=64",
                      "model.kv_lora_rank=24"], r"`model.kv_lora_rank` \(kv_b_proj's input\) = 24 \(whole on every"),
])
def test_config_refuses_what_mla_or_yarn_cannot_mean_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_mla_ignores_the_gqa_head_settings():
    # num_kv_heads=3 divides neither num_heads=4 nor is divided by tp=2, head_dim=5 is odd: meaningless under MLA, not refused.
    cfg = load_config(None, MLA_OVERRIDES + ["model.num_kv_heads=3", "model.head_dim=5", "parallel.tp=2"]).model
    assert (cfg.qk_head_dim, cfg.value_head_dim) == (16, 8)


# ---------------------------------------------------------------- CUDA: the varlen flash-attention core

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernels run on CUDA")


@cuda_only
@pytest.mark.parametrize("d, dv", [(192, 128), (64, 128)], ids=["narrower_v", "wider_v"])
def test_varlen_core_with_another_value_head_dim_matches_the_masked_reference(d, dv):
    gen = torch.Generator().manual_seed(0)
    lengths = [100, 37, 250, 1]
    T, H = sum(lengths), 4
    q, k, v = torch.randn(T, H, d, generator=gen), torch.randn(T, H, d, generator=gen), torch.randn(T, H, dv, generator=gen)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    grad_out = torch.randn(T, H, dv, generator=gen)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = packed_causal_attention(*ref, cu)
    out_ref.backward(grad_out)
    ours = [t.cuda().bfloat16().requires_grad_() for t in (q, k, v)]
    out = packed_causal_attention(*ours, cu.cuda(), 250)
    out.backward(grad_out.cuda().bfloat16())
    assert out.shape == (T, H, dv)
    torch.testing.assert_close(out.float().cpu(), out_ref.detach(), rtol=2e-2, atol=2e-2)  # a few bf16 ulps
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine.grad.float().cpu(), theirs.grad, rtol=3e-2, atol=3e-2)


@cuda_only
def test_mla_model_on_cuda_in_bf16_matches_the_cpu_fp32_model():
    """The whole MLA model through varlen flash attention and the Triton RoPE kernel (rope dim 8 -> 16 here so that it
    is a power of two) under bf16 autocast, against the CPU fp32 SDPA path: loss and gradients within bf16 rounding."""
    # Dense layers only: a routing decision flipped by bf16 rounding would move expert gradients by more than that.
    overrides = dict(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, hidden_size=64, kv_lora_rank=32,
                     first_k_dense=2)
    cpu = mla_model(**overrides)
    gpu = copy.deepcopy(cpu).cuda()
    want = step(cpu)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (sum(LENGTHS),), generator=gen).cuda()
    _, position_ids, cu = (t.cuda() for t in packed_input(1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = gpu(tokens, position_ids, cu, labels=torch.roll(tokens, -1))
    loss.backward()
    torch.testing.assert_close(loss.float().cpu(), want[0], rtol=2e-2, atol=0)
    for name, p in gpu.named_parameters():
        err = float((p.grad.float().cpu() - want[1][name]).norm() / want[1][name].norm().clamp_min(1e-12))
        assert err < 5e-2, f"gradient of {name}: {err:.2e} relative"
