"""Probe (issue #7): what does SwiGLU fused into the expert GEMMs' epilogues save at the Qwen3-30B-A3B expert shapes?

    python bench/probe_swiglu_epilogue.py [--tokens 16384] [--topk 8] [--reps 20]

The MoE layer runs the experts' activation as its own pass over the GEMMs' outputs (`kernels/swiglu.py`): forward,
`torch._grouped_mm` writes h13 = x w13 [M, 2f] and `swiglu_prob` reads it back to write silu(gate) * up * prob
[M, f]; backward, the down projection's dgrad writes dact = dY w2^T [M, f] and the SwiGLU backward reads it with h13 to
write dh13 [M, 2f] and dprob [M]. Fused, the forward GEMM computes a gate tile and its up tile in one program and
writes h13 (backward needs it) and the activation from the registers; the dgrad GEMM's epilogue reads the h13 tiles
and writes dh13 and its share of dprob (an atomic add over column tiles). What each saves is one read and one write
of an [M, f] or [M, 2f] tensor, if the Triton GEMM keeps `_grouped_mm`'s rate.

Rows: the unfused pair as the layer runs it, each part alone, and the fused kernel; its outputs are checked against
the unfused pair's (max error relative to the largest value; the GEMMs sum in different orders, and both round the
GEMM output to bf16 before the activation). Not a training path: the figures and the conclusion are in
bench/RESULTS.md ("SwiGLU in the expert GEMMs' epilogues, probed"). Exits with a message without CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms  # noqa: E402
from kernels._triton import autotune_configs, next_power_of_2  # noqa: E402
from kernels.fp8_grouped_mm import _banded, _tile_of  # noqa: E402
from kernels.swiglu import _swiglu_prob_bwd_kernel, swiglu_prob  # noqa: E402

# (BLOCK_M, BLOCK_N per half, BLOCK_K, warps, stages): two [BLOCK_M, BLOCK_N] accumulators per program.
_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (64, 128, 64, 4, 4),
          (128, 128, 32, 8, 4)]


def _set_fwd_block(nargs):
    nargs["b_desc"].block_shape = [nargs["BLOCK_K"], nargs["BLOCK_N"]]


def _set_bwd_block(nargs):
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


def _configs(hook):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "BAND": band}, num_warps=w, num_stages=s,
                          pre_hook=hook) for m, n, k, w, s in _TILES for band in (8, 1)]


@triton.jit
def _program_tile(offs_ptr, M, F, E, E_PAD: tl.constexpr, BAND: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """(group, column tile, rows, which rows are the group's) of this program; group >= E: no tile, nothing to do."""
    n_tiles = tl.cdiv(F, BLOCK_N)
    pid_m, pid_n = _banded(tl.program_id(0), tl.num_programs(0) // n_tiles, n_tiles, BAND)
    group, row0, row_end = _tile_of(pid_m, offs_ptr, M, E, E_PAD, BLOCK_M)
    rows = row0 + tl.arange(0, BLOCK_M)
    return group, pid_n, rows, rows < row_end


def _grid(M: int, F: int, E: int):
    """Programs for every row tile of every group (at most M / BLOCK_M + E + 1 of them) times the column tiles."""
    return lambda meta: ((triton.cdiv(M, meta["BLOCK_M"]) + E + 1) * triton.cdiv(F, meta["BLOCK_N"]),)


@triton.autotune(configs=autotune_configs(_configs(_set_fwd_block)), key=["F", "K", "E"])
@triton.jit
def _gate_up_swiglu_kernel(a_ptr, b_desc, offs_ptr, prob_ptr, h_ptr, act_ptr, M, F, K: tl.constexpr, E,
                           E_PAD: tl.constexpr, BAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """h[r] = a[r] @ w13[g] (gate half and up half), act[r] = silu(gate) * up * prob[r], rows r of group g."""
    group, pid_n, rows, row_ok = _program_tile(offs_ptr, M, F, E, E_PAD, BAND, BLOCK_M, BLOCK_N)
    if group >= E:
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        acc_g = tl.dot(a, b_desc.load([group * K + kb * BLOCK_K, pid_n * BLOCK_N]), acc_g)
        acc_u = tl.dot(a, b_desc.load([group * K + kb * BLOCK_K, F + pid_n * BLOCK_N]), acc_u)
        a_ptrs += BLOCK_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < F)[None, :]
    gate = acc_g.to(h_ptr.dtype.element_ty)
    up = acc_u.to(h_ptr.dtype.element_ty)
    h_row = h_ptr + rows[:, None].to(tl.int64) * (2 * F)
    tl.store(h_row + cols[None, :], gate, mask=mask)
    tl.store(h_row + F + cols[None, :], up, mask=mask)
    g32, u32 = gate.to(tl.float32), up.to(tl.float32)
    p = tl.load(prob_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    act = g32 * tl.sigmoid(g32) * u32 * p[:, None]
    tl.store(act_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=mask)


def gate_up_swiglu(x, w13, offs, prob):
    E, K, F2 = w13.shape
    M, F = x.shape[0], F2 // 2
    h = torch.empty(M, F2, dtype=x.dtype, device=x.device)
    act = torch.empty(M, F, dtype=x.dtype, device=x.device)
    b_desc = TensorDescriptor.from_tensor(w13.view(E * K, F2), [64, 128])
    _gate_up_swiglu_kernel[_grid(M, F, E)](x, b_desc, offs, prob, h, act, M, F, K, E,
                                           E_PAD=next_power_of_2(E + 1))
    return h, act


@triton.autotune(configs=autotune_configs(_configs(_set_bwd_block)), key=["F", "H", "E"],
                 reset_to_zero=["dprob_ptr"])
@triton.jit
def _down_dgrad_swiglu_kernel(dy_ptr, b_desc, offs_ptr, h_ptr, prob_ptr, dh_ptr, dprob_ptr, M, F, H: tl.constexpr, E,
                              E_PAD: tl.constexpr, BAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    """dact[r] = dY[r] @ w2[g]^T, then the SwiGLU backward on it: dh[r] (gate and up halves) and dprob[r]."""
    group, pid_n, rows, row_ok = _program_tile(offs_ptr, M, F, E, E_PAD, BAND, BLOCK_M, BLOCK_N)
    if group >= E:
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = dy_ptr + rows[:, None].to(tl.int64) * H + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, H // BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = b_desc.load([group * F + pid_n * BLOCK_N, kb * BLOCK_K])  # w2[g][cols, k-tile]: [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < F)[None, :]
    dact = acc.to(dh_ptr.dtype.element_ty).to(tl.float32)  # rounded as the unfused dgrad's output is
    h_row = h_ptr + rows[:, None].to(tl.int64) * (2 * F)
    gate = tl.load(h_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_row + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    p = tl.load(prob_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    silu = gate * s
    d_gate = dact * up * p[:, None] * s * (1.0 + gate * (1.0 - s))
    d_up = dact * silu * p[:, None]
    dh_row = dh_ptr + rows[:, None].to(tl.int64) * (2 * F)
    tl.store(dh_row + cols[None, :], d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_row + F + cols[None, :], d_up.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.atomic_add(dprob_ptr + rows, tl.sum(dact * silu * up, axis=1), mask=row_ok)


def down_dgrad_swiglu(dy, w2, offs, h, prob):
    E, F, H = w2.shape
    M = dy.shape[0]
    dh = torch.empty_like(h)
    dprob = torch.zeros(M, dtype=torch.float32, device=dy.device)
    b_desc = TensorDescriptor.from_tensor(w2.view(E * F, H), [128, 64])
    _down_dgrad_swiglu_kernel[_grid(M, F, E)](dy, b_desc, offs, h, prob, dh, dprob, M, F, H, E,
                                              E_PAD=next_power_of_2(E + 1))
    return dh, dprob


def swiglu_bwd(h, prob, dact):
    """The layer's SwiGLU backward kernel, called as its autograd function does."""
    M, F = dact.shape
    dh = torch.empty_like(h)
    dprob = torch.zeros_like(prob)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_N"]),)  # noqa: E731
    _swiglu_prob_bwd_kernel[grid](h, prob, dact, dh, dprob, M, F)
    return dh, dprob


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_swiglu_epilogue needs a CUDA GPU")
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    E, T, k, H, F = args.experts, args.tokens, args.topk, args.hidden, args.ffn
    M = T * k
    expert = torch.rand(T, E, device=dev).topk(k, dim=1).indices.flatten().sort().values
    offs = torch.bincount(expert, minlength=E).cumsum(0).to(torch.int32)
    x = torch.randn(M, H, device=dev, dtype=dt)
    w13 = torch.randn(E, H, 2 * F, device=dev, dtype=dt) / H ** 0.5
    w2 = torch.randn(E, F, H, device=dev, dtype=dt) / F ** 0.5
    prob = torch.rand(M, device=dev)
    dy = torch.randn(M, H, device=dev, dtype=dt)
    w2t = w2.transpose(1, 2)

    dense_a, dense_b = torch.randn(8192, 8192, device=dev, dtype=dt), torch.randn(8192, 8192, device=dev, dtype=dt)
    dense_ms = time_ms(lambda: dense_a @ dense_b, 5, args.reps)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"dense 8192^3 {2 * 8192 ** 3 / dense_ms / 1e9:.0f} TFLOP/s | M={M} h={H} f={F} E={E}")

    with torch.no_grad():
        h_ref = torch._grouped_mm(x, w13, offs=offs)
        act_ref = swiglu_prob(h_ref, prob)
        h, act = gate_up_swiglu(x, w13, offs, prob)
        dact_ref = torch._grouped_mm(dy, w2t, offs=offs)
        dh_ref, dprob_ref = swiglu_bwd(h_ref, prob, dact_ref)
        dh, dprob = down_dgrad_swiglu(dy, w2, offs, h_ref, prob)
    print(f"forward: h max rel err {rel_err(h, h_ref):.1e}, act {rel_err(act, act_ref):.1e}; backward: dh "
          f"{rel_err(dh, dh_ref):.1e}, dprob {rel_err(dprob, dprob_ref):.1e}")

    fwd_flop, bwd_flop = 2 * M * H * 2 * F, 2 * M * H * F
    rows = [
        ("fwd: _grouped_mm + swiglu_prob (now)", fwd_flop, lambda: swiglu_prob(torch._grouped_mm(x, w13, offs=offs),
                                                                               prob)),
        ("fwd: _grouped_mm alone", fwd_flop, lambda: torch._grouped_mm(x, w13, offs=offs)),
        ("fwd: swiglu_prob alone", None, lambda: swiglu_prob(h_ref, prob)),
        ("fwd: triton GEMM + SwiGLU epilogue", fwd_flop, lambda: gate_up_swiglu(x, w13, offs, prob)),
        ("bwd: _grouped_mm dgrad + swiglu bwd (now)", bwd_flop,
         lambda: swiglu_bwd(h_ref, prob, torch._grouped_mm(dy, w2t, offs=offs))),
        ("bwd: _grouped_mm dgrad alone", bwd_flop, lambda: torch._grouped_mm(dy, w2t, offs=offs)),
        ("bwd: swiglu bwd alone", None, lambda: swiglu_bwd(h_ref, prob, dact_ref)),
        ("bwd: triton dgrad + SwiGLU bwd epilogue", bwd_flop, lambda: down_dgrad_swiglu(dy, w2, offs, h_ref, prob)),
    ]
    with torch.no_grad():
        for name, flop, fn in rows:
            ms = time_ms(fn, 5, args.reps)
            rate = f"{flop / ms / 1e9:8.0f} TFLOP/s" if flop else ""
            print(f"  {name:<44} {ms:7.3f} ms {rate}")
    for kernel in (_gate_up_swiglu_kernel, _down_dgrad_swiglu_kernel):
        print(f"{kernel.base_fn.__name__}: {kernel.best_config}")


if __name__ == "__main__":
    main()
