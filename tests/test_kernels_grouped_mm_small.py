"""grouped_mm_small: the Triton kernel (on CUDA, else in Triton's CPU interpreter) against its torch reference, and on
CUDA against `torch._grouped_mm`: groups without rows, a group over several row tiles, K and N not multiples of the
tiles, rows past the last group (not computed: not compared)."""

import pytest
import torch
from kernels_interpreter import DEVICE, ON_CUDA, kernels_on_device  # noqa: F401  (first: before triton is imported)

from kernels.grouped_mm_small import grouped_mm_small, grouped_mm_small_reference


@pytest.mark.parametrize("K,N", [(200, 100), (64, 48)])
def test_kernel_matches_the_group_by_group_products(K, N):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    counts = [3, 0, 70, 1, 0, 17]  # empty groups, one over three tiles of 32 rows
    offs = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    rows = int(offs[-1]) + 5  # 5 rows past the last group
    a = torch.randn(rows, K, device=DEVICE).to(dtype)
    b = (torch.randn(len(counts), K, N, device=DEVICE) / K ** 0.5).to(dtype)
    got = grouped_mm_small(a, b, offs)
    assert got.shape == (rows, N) and got.dtype == dtype
    done = int(offs[-1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:done].float(), grouped_mm_small_reference(a, b, offs)[:done].float(),
                               rtol=tol, atol=tol)
    if ON_CUDA and K % 8 == 0 and N % 8 == 0:  # torch._grouped_mm wants rows of a multiple of 16 bytes
        torch.testing.assert_close(got[:done], torch._grouped_mm(a, b, offs=offs)[:done], rtol=tol, atol=tol)


def test_bad_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[E, K, N\]"):
        grouped_mm_small(torch.zeros(4, 8), torch.zeros(2, 6, 3), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        grouped_mm_small(torch.zeros(4, 8), torch.zeros(2, 8, 3), torch.zeros(2, dtype=torch.int64))
