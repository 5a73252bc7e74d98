"""Probe (issue #7): can bf16 Triton grouped GEMMs that gather their rows (the permutation fused into the expert GEMMs'
operand loads) beat torch's gather + torch._grouped_mm at the Qwen3-30B-A3B expert shapes?

    python bench/probe_gather_mm.py [--tokens 16384] [--topk 8] [--reps 20]

Forward rows: `_grouped_mm` on already-permuted rows; x[src] gather + `_grouped_mm` (what the MoE layer does now); a
Triton grouped GEMM on permuted rows; the same kernel gathering rows through `src` (the fusion), and also writing the
gathered rows out (what backward's wgrad would read). B (the expert weights [E, K, N], N contiguous as the layer holds
them) through a TMA descriptor, A through pointer loads (gathered rows cannot use a plain TMA tile load on Hopper).
Wgrad rows (dW[g] = x[src[rows of g]]^T dY[rows of g]): `_grouped_mm` on permuted rows, gather + `_grouped_mm`, a
Triton grouped wgrad on permuted rows and gathering. Not a training path: the figures, what they are worth in the MoE
layer and why the fusion was not kept are in bench/RESULTS.md ("The permutation fused into the expert GEMMs").
Exits with a message without CUDA.
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
from kernels.fp8_grouped_mm import _banded, _tile_of  # noqa: E402
from kernels._triton import autotune_configs, next_power_of_2  # noqa: E402


def _set_b_block(nargs):
    nargs["b_desc"].block_shape = [nargs["BLOCK_K"], nargs["BLOCK_N"]]


_TILES = [(128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
          (64, 256, 64, 4, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 5)]
_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "BAND": band}, num_warps=w, num_stages=s,
                          pre_hook=_set_b_block)
            for m, n, k, w, s in _TILES for band in (8, 1)]


@triton.autotune(configs=autotune_configs(_CONFIGS), key=["N", "K", "E", "GATHER", "KEEP"])
@triton.jit
def _gather_mm_kernel(a_ptr, src_ptr, b_desc, offs_ptr, out_ptr, kept_ptr, M, N, K: tl.constexpr, E, stride_am,
                      stride_om, E_PAD: tl.constexpr, GATHER: tl.constexpr, KEEP: tl.constexpr, BAND: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _banded(tl.program_id(0), tl.num_programs(0) // n_tiles, n_tiles, BAND)
    group, row0, row_end = _tile_of(pid_m, offs_ptr, M, E, E_PAD, BLOCK_M)
    if group >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    if GATHER:
        src = tl.load(src_ptr + rows, mask=row_ok, other=0)
    else:
        src = rows
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None].to(tl.int64) * stride_am + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_steps: tl.constexpr = K // BLOCK_K
    for kb in range(0, k_steps):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = b_desc.load([group * K + kb * BLOCK_K, pid_n * BLOCK_N])
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
    # The gathered rows also written out in expert order (for backward), by the first column tile's programs, in a
    # second pass over them after the products: storing the loaded tile `a` inside the loop above gave wrong products
    # on an H100 with Triton 3.6 (at every shape and tile tried; bench/RESULTS.md).
    if KEEP:
        if pid_n == 0:
            a_ptrs = a_ptr + src[:, None].to(tl.int64) * stride_am + ks[None, :]
            kept = kept_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
            for kb in range(0, k_steps):
                tl.store(kept, tl.load(a_ptrs, mask=row_ok[:, None], other=0.0), mask=row_ok[:, None])
                a_ptrs += BLOCK_K
                kept += BLOCK_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


def gather_mm(x, src, w, offs, keep=False):
    """out[r] = x[src[r]] @ w[g] for the rows r of group g (src None: x's own rows); with `keep`, also x[src]."""
    E, K, N = w.shape
    M = src.shape[0] if src is not None else x.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    kept = torch.empty(M, K, dtype=x.dtype, device=x.device) if keep else out
    b_desc = TensorDescriptor.from_tensor(w.view(E * K, N), [64, 128])
    grid = lambda meta: ((triton.cdiv(M, meta["BLOCK_M"]) + E + 1) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _gather_mm_kernel[grid](x, src if src is not None else offs, b_desc, offs, out, kept, M, N, K, E, x.stride(0),
                            out.stride(0), E_PAD=next_power_of_2(E + 1), GATHER=src is not None, KEEP=keep)
    return (out, kept) if keep else out


_WGRAD_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
                (128, 128, 32, 4, 4), (256, 128, 64, 8, 3)]


@triton.autotune(configs=autotune_configs([triton.Config({"BLOCK_K": k, "BLOCK_N": n, "BLOCK_R": r}, num_warps=w,
                                                         num_stages=st) for k, n, r, w, st in _WGRAD_TILES]),
                 key=["N", "K", "E", "GATHER"])
@triton.jit
def _wgrad_kernel(x_ptr, src_ptr, dy_ptr, offs_ptr, dw_ptr, K, N, E, stride_xm, stride_dym,
                  GATHER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """dW[g][k-tile, n-tile] = sum over the rows r of group g of x[src[r]][k-tile]^T dY[r][n-tile]."""
    k_tiles, n_tiles = tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    g = pid // (k_tiles * n_tiles)
    pid_k = pid % (k_tiles * n_tiles) // n_tiles
    pid_n = pid % n_tiles
    two = tl.arange(0, 2)  # offs[g-1], offs[g] as a vector, then scalars (0-d in the interpreter too)
    bounds = tl.load(offs_ptr + g - 1 + two, mask=g - 1 + two >= 0, other=0)
    start, end = tl.sum(tl.where(two == 0, bounds, 0), 0), tl.sum(tl.where(two == 1, bounds, 0), 0)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for i in range(0, tl.cdiv(end - start, BLOCK_R)):
        rows = start + i * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < end
        if GATHER:
            src = tl.load(src_ptr + rows, mask=ok, other=0)
        else:
            src = rows
        a = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=ok[:, None], other=0.0)
        b = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dym + ns[None, :], mask=ok[:, None], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    out = dw_ptr + g.to(tl.int64) * K * N + ks[:, None] * N + ns[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=(ks < K)[:, None] & (ns < N)[None, :])


def grouped_wgrad(x, src, dy, offs):
    """dW [E, K, N]: dW[g] = x[src[rows of g]]^T @ dy[rows of g] (src None: x's own rows)."""
    E = offs.shape[0]
    K, N = x.shape[1], dy.shape[1]
    dw = torch.empty(E, K, N, dtype=dy.dtype, device=dy.device)
    grid = lambda meta: (E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _wgrad_kernel[grid](x, src if src is not None else offs, dy, offs, dw, K, N, E, x.stride(0), dy.stride(0),
                        GATHER=src is not None)
    return dw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_gather_mm needs a CUDA GPU")
    dev = "cuda"
    torch.manual_seed(0)
    E, T, k = 128, args.tokens, args.topk
    M = T * k
    dense_a, dense_b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16), torch.randn(8192, 8192, device=dev,
                                                                                              dtype=torch.bfloat16)
    dense_ms = time_ms(lambda: dense_a @ dense_b, 5, args.reps)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"dense 8192^3 {2 * 8192 ** 3 / dense_ms / 1e9:.0f} TFLOP/s")
    for name, K, N in (("gate/up", 2048, 1536), ("down", 768, 2048)):
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        expert = torch.rand(T, E, device=dev).topk(k, dim=1).indices.flatten()
        order = expert.argsort(stable=True)
        src = (order // k).to(torch.int32)
        offs = torch.bincount(expert, minlength=E).cumsum(0).to(torch.int32)
        w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) / K ** 0.5
        xp = x[src]
        ref = torch._grouped_mm(xp, w, offs=offs)
        mine = gather_mm(x, src, w, offs)
        plain = gather_mm(xp, None, w, offs)
        err = ((mine.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        err2 = ((plain.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        flop = 2 * M * K * N
        rows = {
            "_grouped_mm (permuted rows)": lambda: torch._grouped_mm(xp, w, offs=offs),
            "gather + _grouped_mm": lambda: torch._grouped_mm(x[src], w, offs=offs),
            "triton (permuted rows)": lambda: gather_mm(xp, None, w, offs),
            "triton gathering rows": lambda: gather_mm(x, src, w, offs),
            "triton gathering, keeping x[src]": lambda: gather_mm(x, src, w, offs, keep=True),
            "gather alone": lambda: x[src],
        }
        keep_out, kept = gather_mm(x, src, w, offs, keep=True)
        kept_err = (kept != xp).sum().item()
        err3 = ((keep_out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        dw_ref = torch._grouped_mm(xp.t(), dy, offs=offs)
        scale = dw_ref.float().abs().max()
        dw_err = ((grouped_wgrad(xp, None, dy, offs).float() - dw_ref.float()).abs().max() / scale).item()
        dw_gerr = ((grouped_wgrad(x, src, dy, offs).float() - dw_ref.float()).abs().max() / scale).item()
        rows.update({
            "wgrad _grouped_mm (x[src])": lambda: torch._grouped_mm(xp.t(), dy, offs=offs),
            "wgrad gather + _grouped_mm": lambda: torch._grouped_mm(x[src].t(), dy, offs=offs),
            "wgrad triton (x[src])": lambda: grouped_wgrad(xp, None, dy, offs),
            "wgrad triton gathering rows": lambda: grouped_wgrad(x, src, dy, offs),
        })
        print(f"{name}: M={M} K={K} N={N} E={E}  max rel err gather {err:.1e} plain {err2:.1e} keeping {err3:.1e}; "
              f"kept rows wrong {kept_err}; wgrad max rel err {dw_err:.1e}, gathering {dw_gerr:.1e}")
        for label, fn in rows.items():
            ms = time_ms(fn, 5, args.reps)
            print(f"  {label:34s} {ms:7.3f} ms  {flop / ms / 1e9:6.0f} TFLOP/s")
    for kernel in (_gather_mm_kernel, _wgrad_kernel):
        for key, cfg in kernel.cache.items():
            print(f"  chosen for {kernel.fn.__name__} {key[:5]}: {cfg}")


if __name__ == "__main__":
    main()
