"""decode_attention: the Triton kernel (on CUDA, else in Triton's CPU interpreter) against its torch reference (the
slots' caches gathered, then SDPA under a mask): random caches, rows on different slots and lengths (position 0, the
end of a block of positions and the cache's last), two rows on one slot (the decode step's padding rows share the
spare slot), grouped-query and plain heads, a value dim other than the key dim."""

import pytest
import torch
from kernels_interpreter import DEVICE, ON_CUDA, kernels_on_device  # noqa: F401  (first: before triton is imported)

import kernels.decode_attention as decode_attention_module
from kernels.decode_attention import decode_attention, decode_attention_reference, split_positions

DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]  # the interpreter has no bf16 dot


@pytest.mark.parametrize("split_min", [256, 32], ids=["whole_rows", "split_rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("heads,kv_heads,d,dv", [(8, 2, 16, 16), (3, 3, 32, 16), (4, 1, 16, 32)],
                         ids=["gqa", "mha_dv16", "mqa_dv32"])
def test_kernel_matches_the_gathered_sdpa(dtype, heads, kv_heads, d, dv, split_min, monkeypatch):
    """Whole rows a program each, and rows split over programs (splits of 32 positions: 3 for the cache's 72, the
    later ones empty for the rows at positions 0 and 17) merged by `combine_splits`."""
    monkeypatch.setattr(decode_attention_module, "SPLIT_MIN", split_min)
    assert split_positions(6 * kv_heads, 72, 32) == ((1, 96) if split_min == 256 else (3, 32))
    torch.manual_seed(0)
    slots, max_len = 6, 72
    k_cache = torch.randn(slots, kv_heads, max_len, d, device=DEVICE).to(dtype)
    v_cache = torch.randn(slots, kv_heads, max_len, dv, device=DEVICE).to(dtype)
    slot = torch.tensor([4, 0, 2, 5, 5, 1], device=DEVICE)
    pos = torch.tensor([0, 31, 71, 40, 0, 17], device=DEVICE)
    q = torch.randn(len(slot), heads, d, device=DEVICE).to(dtype)
    want = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), slot, pos, span=max_len)
    got = decode_attention(q, k_cache, v_cache, slot, pos, span=max_len)
    assert got.shape == (len(slot), heads, dv) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # position 0 alone: the row's value vectors themselves
    torch.testing.assert_close(got[0].float(), v_cache[4, :, 0].float().repeat_interleave(heads // kv_heads, 0),
                               rtol=tol, atol=tol)


def test_positions_past_a_row_are_never_read():
    """Garbage (inf) in the cache past each row's position changes nothing."""
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(2, 4, 2, 50, 16, device=DEVICE)
    slot, pos = torch.tensor([1, 0], device=DEVICE), torch.tensor([20, 33], device=DEVICE)
    q = torch.randn(2, 4, 16, device=DEVICE)
    clean = decode_attention(q, k_cache, v_cache, slot, pos, span=50)
    k_cache[1, :, 21:], k_cache[0, :, 34:], v_cache[1, :, 21:] = float("inf"), float("inf"), float("nan")
    assert torch.equal(decode_attention(q, k_cache, v_cache, slot, pos, span=50), clean)


def test_bad_shapes_are_refused_naming_them():
    cache = torch.zeros(2, 2, 8, 16)
    with pytest.raises(ValueError, match="3 query heads of dim 16 cannot read 2 key heads"):
        decode_attention(torch.zeros(1, 3, 16), cache, cache, torch.zeros(1, dtype=torch.int64),
                         torch.zeros(1, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="slot and pos of shape"):
        decode_attention(torch.zeros(2, 4, 16), cache, cache, torch.zeros(1, dtype=torch.int64),
                         torch.zeros(2, dtype=torch.int64), 8)
