"""decode_latent_attention: the Triton kernel (on CUDA, else in Triton's CPU interpreter) against its torch reference
(the slots' latents gathered, then scores, a masked softmax and the weighted sum as batched GEMMs): random caches,
rows on different slots and lengths (position 0, the end of a block of positions and the cache's last), two rows on one
slot (the decode step's padding rows share the spare slot), head counts below, at and across a head block, dims that
are no power of two; and the model's absorbed MLA decode (mla.py `attend_latent`) through it against the packed core
over expanded keys and values."""

import pytest
import torch
from kernels_interpreter import DEVICE, ON_CUDA, kernels_on_device  # noqa: F401  (first: before triton is imported)

import kernels.decode_attention as decode_attention_module
from kernels.decode_attention import split_positions
from kernels.decode_latent_attention import decode_latent_attention, decode_latent_attention_reference

DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]  # the interpreter has no bf16 dot


def _inputs(heads: int, r: int, dr: int, dtype, seed: int = 0, slots: int = 6, max_len: int = 72):
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(slots, max_len, r, generator=gen).to(DEVICE, dtype)
    k_rope = torch.randn(slots, max_len, dr, generator=gen).to(DEVICE, dtype)
    slot = torch.tensor([4, 0, 2, 5, 5, 1], device=DEVICE)
    pos = torch.tensor([0, 31, 71, 40, 0, 17], device=DEVICE)
    q_latent = torch.randn(len(slot), heads, r, generator=gen).to(DEVICE, dtype)
    q_rope = torch.randn(len(slot), heads, dr, generator=gen).to(DEVICE, dtype)
    return q_latent, q_rope, latent, k_rope, slot, pos


@pytest.mark.parametrize("split_min", [256, 32], ids=["whole_rows", "split_rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("heads,r,dr", [(4, 32, 16), (16, 16, 16), (20, 24, 8)],
                         ids=["few_heads", "one_block", "two_blocks_odd_dims"])
def test_kernel_matches_the_gathered_reference(dtype, heads, r, dr, split_min, monkeypatch):
    """Whole rows, and rows split over programs (two splits of 64 positions: the second empty for the rows at
    positions 0, 17 and 31) merged by `combine_splits`."""
    monkeypatch.setattr(decode_attention_module, "SPLIT_MIN", split_min)
    assert split_positions(6, 72, 64)[0] == (1 if split_min == 256 else 2)
    q_latent, q_rope, latent, k_rope, slot, pos = _inputs(heads, r, dr, dtype)
    scale = 0.3
    want = decode_latent_attention_reference(q_latent.float(), q_rope.float(), latent.float(), k_rope.float(), slot,
                                             pos, 72, scale)
    got = decode_latent_attention(q_latent, q_rope, latent, k_rope, slot, pos, 72, scale)
    assert got.shape == (len(slot), heads, r) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # position 0 alone: every head's result is that position's latent itself
    torch.testing.assert_close(got[0].float(), latent[4, 0].float().expand(heads, -1), rtol=tol, atol=tol)


def test_positions_past_a_row_are_never_read():
    """Garbage (inf, nan) in the caches past each row's position changes nothing."""
    q_latent, q_rope, latent, k_rope, slot, pos = _inputs(4, 16, 16, torch.float32, seed=1)
    clean = decode_latent_attention(q_latent, q_rope, latent, k_rope, slot, pos, 72, 0.25)
    for s, p in zip(slot.tolist(), pos.tolist()):
        if s != 5:  # slot 5 holds two rows, at positions 40 and 0
            latent[s, p + 1:], k_rope[s, p + 1:] = float("nan"), float("inf")
    assert torch.equal(decode_latent_attention(q_latent, q_rope, latent, k_rope, slot, pos, 72, 0.25), clean)


def test_bad_shapes_are_refused_naming_them():
    q_latent, q_rope, latent, k_rope, slot, pos = _inputs(4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="queries of dims 16 \\+ 16 cannot read caches"):
        decode_latent_attention(q_latent, q_rope, latent[..., :8], k_rope, slot, pos, 72, 1.0)
    with pytest.raises(ValueError, match="slot and pos of shape"):
        decode_latent_attention(q_latent, q_rope, latent, k_rope, slot[:2], pos, 72, 1.0)


def test_the_models_absorbed_mla_decode_through_the_kernel_equals_the_packed_core():
    """mla.py `attend_latent` on a cache of two slots (a document's tokens as queries against the latents up to each,
    in slot 1; slot 0 garbage) is the packed core's result over the keys and values expanded from those latents."""
    from services.common.config import ModelConfig
    from services.trainer.model.attention import packed_causal_attention
    from services.trainer.model.mla import MLAttention

    torch.manual_seed(3)
    cfg = ModelConfig(hidden_size=32, num_heads=4, q_lora_rank=16, attention="mla", kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8)
    attn = MLAttention(cfg).to(DEVICE)
    n = 40
    x = torch.randn(n, 32, device=DEVICE)
    with torch.no_grad():
        q, latent, k_rope = attn.query_and_latent(x, torch.arange(n, device=DEVICE))
        want = packed_causal_attention(q, *attn.expand(latent, k_rope), torch.tensor([0, n], dtype=torch.int32,
                                                                                     device=DEVICE))
        latent_cache = torch.full((2, 64, 16), float("nan"), device=DEVICE)
        rope_cache = torch.full((2, 64, 16), float("nan"), device=DEVICE)
        latent_cache[1, :n], rope_cache[1, :n] = latent, k_rope
        got = attn.attend_latent(q, latent_cache, rope_cache, torch.ones(n, dtype=torch.int64, device=DEVICE),
                                 torch.arange(n, device=DEVICE), 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
