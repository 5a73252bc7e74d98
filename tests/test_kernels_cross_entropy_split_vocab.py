"""linear_cross_entropy_sum with the vocabulary split over ranks (tensor parallelism's output layer): every rank holds
rows [start, start + V_r) of the output weight and all tokens; the loss must be the whole-vocabulary loss on every
rank, the ranks' grad_h must sum to the whole grad_h, and each rank's grad_W must be its rows of the whole grad_W.

Ranks are gloo processes on CPU, each running the Triton row step in Triton's CPU interpreter and the torch one. fp32:
both sides do the same arithmetic up to the order of sums (over the ranks' slices, over chunks), so rtol 1e-5 and
atol 1e-6, as for the single-rank kernel (tests/test_kernels_cross_entropy.py).
"""

import pytest
import torch
import torch.distributed as dist
from kernels_interpreter import DEVICE, ON_CUDA, interpreted_gloo_rank, kernels_on_device  # noqa: F401  (first)
from parallel_harness import spawn_ranks

from kernels.cross_entropy import (ce_slice_grad_reference, ce_slice_grad_triton, ce_slice_stats_reference,
                                   ce_slice_stats_triton, linear_cross_entropy_sum,
                                   linear_cross_entropy_sum_reference)
from services.trainer.model.loss import IGNORE_INDEX, cross_entropy_sum

FUSED = {"triton": linear_cross_entropy_sum, "torch": linear_cross_entropy_sum_reference}
# The ranks are gloo processes on CPU tensors: the Triton row step runs there in the interpreter, which a process
# whose triton is built for the GPU cannot use; on a CUDA machine the slice kernels' own test below runs them.
SPLIT_RANK_IMPLS = ["torch"] if ON_CUDA else sorted(FUSED)


def make_case(T, H, V, ignored=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g)
    w = (torch.randn(V, H, generator=g) * H ** -0.5 * 4)  # logits of order 4: a peaked softmax
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.randperm(T, generator=g)[:ignored]] = IGNORE_INDEX
    return h, w, labels


def slice_bounds(V: int, world: int) -> list[int]:
    """Uneven slices on purpose (the trainer's are even): the kernel must not assume equal widths."""
    cuts = [V * r // world for r in range(world + 1)]
    cuts[1] += 1
    return cuts


def _worker(rank, world, case, chunk, out_dir):
    with interpreted_gloo_rank(rank, world, out_dir):
        h, w, labels = make_case(*case)
        cuts = slice_bounds(w.shape[0], world)
        start, stop = cuts[rank], cuts[rank + 1]
        out = {}
        for impl in SPLIT_RANK_IMPLS:
            fn = FUSED[impl]
            hh, ww = h.clone().requires_grad_(), w[start:stop].clone().requires_grad_()
            loss = fn(hh, ww, labels, chunk_size=chunk, vocab_group=dist.group.WORLD, vocab_start=start)
            loss.mul(0.5).backward()  # an incoming gradient other than 1
            out[impl] = (loss.detach(), hh.grad, ww.grad, (start, stop))
        torch.save(out, f"{out_dir}/rank{rank}.pt")


# T, H, V, chunk: several chunks with a ragged tail; a vocabulary over the kernel's first 4096-column block.
@pytest.mark.parametrize("world,case,chunk", [(2, (37, 24, 100, 3), 8), (3, (20, 8, 5000, 5), 7)],
                         ids=["2ranks", "3ranks-wide"])
def test_split_vocabulary_gives_the_whole_vocabulary_loss_and_gradients(tmp_path, world, case, chunk):
    h, w, labels = make_case(*case)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = cross_entropy_sum(hh @ ww.T, labels)
    want.mul(0.5).backward()
    ranks = spawn_ranks(_worker, (world, case, chunk, str(tmp_path)), world, str(tmp_path))
    for impl in SPLIT_RANK_IMPLS:
        grad_h = sum(r[impl][1] for r in ranks)
        torch.testing.assert_close(grad_h, hh.grad, rtol=1e-5, atol=1e-6, msg=impl)
        for r in ranks:
            loss, _, grad_w, (start, stop) = r[impl]
            torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6, msg=impl)
            torch.testing.assert_close(grad_w, ww.grad[start:stop], rtol=1e-5, atol=1e-6, msg=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_slice_kernels_equal_their_torch_references(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 5000, generator=g) * 3).to(DEVICE, dtype)
    local = torch.randint(0, 5000, (9,), generator=g)
    local[[2, 5]] = -1  # labels in another rank's slice (or ignored)
    local = local.to(DEVICE)
    stats = ce_slice_stats_triton(logits, local)
    torch.testing.assert_close(stats, ce_slice_stats_reference(logits, local), rtol=1e-5, atol=1e-5)
    assert stats[2, 2] == 0 and stats[2, 5] == 0  # no target logit outside the slice
    lse = stats[0] + stats[1].log()
    lse[7], local[7] = float("inf"), -1  # how the row step marks an ignored row
    got, want = logits.clone(), logits.clone()
    ce_slice_grad_triton(got, local, lse)
    ce_slice_grad_reference(want, local, lse)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-6)
    assert not got[7].any()  # an ignored row: no gradient
    # A row's gradient over its slice sums to (its softmax mass in the slice) - 1 where the label is in the slice.
    torch.testing.assert_close(got.float().sum(dim=1)[[0, 1]], (logits.float()[[0, 1]] - lse[[0, 1], None]).exp().sum(1)
                               - 1, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
