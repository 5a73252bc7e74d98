"""Compile every kernel for a GPU architecture without a GPU (Triton's bundled ptxas), to catch what the interpreter
lets through (loop-carried type changes, unsupported ops) on CPU-only machines.

    python -m kernels.compile_check [--arch 90]

Must run in a process where TRITON_INTERPRET is unset (interpreted kernels cannot be compiled). Prints one line per
kernel variant and exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction


def _jit_function(kernel) -> JITFunction:
    while not isinstance(kernel, JITFunction):  # autotuned kernels wrap the JITFunction
        kernel = kernel.fn
    return kernel


def _variants():
    """(kernel, pointer/scalar signature, constexprs, num_warps) at the Qwen3-30B-A3B shapes, bf16 and fp32."""
    rows = importlib.import_module("kernels._rows")
    ce = importlib.import_module("kernels.cross_entropy")
    permute = importlib.import_module("kernels.permute")
    router = importlib.import_module("kernels.router")
    swiglu = importlib.import_module("kernels.swiglu")
    fp8 = importlib.import_module("kernels.fp8_grouped_mm")
    fp8q = importlib.import_module("kernels.fp8_quantize")
    adamw = importlib.import_module("kernels.adamw")
    hnr = importlib.import_module("kernels.head_norm_rope")
    for remainder in (False, True):  # bf16 parameters with an fp32 master, or with its int16 remainders
        yield (adamw._adamw_kernel,
               {"master_ptr": "*i16" if remainder else "*fp32", "grad_ptr": "*bf16", "exp_avg_ptr": "*bf16",
                "exp_avg_sq_ptr": "*bf16", "param_ptr": "*bf16", "divisor_ptr": "*fp32", "n": "i64",
                **{name: "fp32" for name in ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size",
                                             "bc2_sqrt", "eps")}},
               {"HAS_PARAM": True, "HAS_DIVISOR": True, "REMAINDER": remainder, "BLOCK": adamw.BLOCK}, adamw.NUM_WARPS)
    for has_scale in (False, True):  # QK-norm + RoPE, Qwen3-30B-A3B heads (32 q, 4 k, head_dim 128)
        heads = {"HQ": 32, "HK": 4, "HALF": 64, "HAS_SCALE": has_scale}
        yield (hnr._head_norm_rope_fwd_kernel,
               {**{f"{t}_ptr": "*bf16" for t in ("q", "k", "q_out", "k_out")}, "q_scale_ptr": "*fp32",
                "k_scale_ptr": "*fp32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "T": "i32", "eps": "fp32"},
               {**heads, "BLOCK_T": 4, "BLOCK_H": 4}, 4)
        yield (hnr._head_norm_rope_bwd_kernel,
               {**{f"{t}_ptr": "*bf16" for t in ("q", "k", "dq_out", "dk_out", "dq", "dk")}, "q_scale_ptr": "*fp32",
                "k_scale_ptr": "*fp32", "dq_scale_partial_ptr": "*fp32", "dk_scale_partial_ptr": "*fp32",
                "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "T": "i32", "eps": "fp32"},
               {**heads, "BLOCK_T": 16, "BLOCK_H": 2}, 4)
    for blockwise in (False, True):  # the experts' gate/up GEMM (K=2048, N=1536) and the row/weight quantisers
        # blockwise loads through TMA descriptors (a 128x64 tile, one of its configs), tensorwise through pointers (its
        # descriptors are None; a 128x256 tile, one of its configs)
        tiles = {"BLOCK_M": 128, "BLOCK_N": 64 if blockwise else 256, "BAND": 8}
        descs = ({"a_desc": "tensordesc<fp8e4nv[128, 128]>", "b_desc": "tensordesc<fp8e4nv[64, 128]>"} if blockwise
                 else {})
        for fast_accum in (False,) if blockwise else (False, True):  # tensorwise: split and fast accumulation
            yield (fp8._fp8_grouped_mm_kernel,
                   {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", **descs, "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
                    "offs_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "E": "i32",
                    **{f"stride_{s}": "i32" for s in ("am", "be", "bn", "om", "asm", "ask", "bse", "bsn", "bsk")}},
                   {"K": 2048, "E_PAD": 256, "BLOCKWISE": blockwise, "FAST_ACCUM": fast_accum, "SCALE_BLOCK": 128,
                    **tiles, "BLOCK_K": 128, **({} if blockwise else {"a_desc": None, "b_desc": None})},
                   4 if blockwise else 8)
        yield (fp8q._quantize_rows_kernel,
               {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "stride_xm": "i32",
                "stride_sm": "i32", "stride_sk": "i32"},
               {"K": 2048, "BLOCKWISE": blockwise, "BLOCK_M": 16 if blockwise else 1,
                "BLOCK_K": 128 if blockwise else 2048, "FP8_MAX": 448.0, "EPS": 1e-12, "ROUND_FIRST": False}, 4)
        yield (fp8q._quantize_weight_kernel,
               {"w_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "N": "i32",
                "stride_se": "i32", "stride_sk": "i32", "stride_sn": "i32"},
               {"BLOCKWISE": blockwise, "BLOCK": 128, "FP8_MAX": 448.0, "EPS": 1e-12, "ROUND_FIRST": False}, 8)
    yield (fp8q._quantize_rows_kernel,  # rows longer than one program holds: read twice, in 1024-wide chunks
           {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "stride_xm": "i32",
            "stride_sm": "i32", "stride_sk": "i32"},
           {"K": 28672, "BLOCKWISE": False, "BLOCK_M": 8, "BLOCK_K": 1024, "FP8_MAX": 448.0, "EPS": 1e-12,
            "ROUND_FIRST": False}, 4)
    yield (fp8q._transpose_bytes_kernel, {"q_ptr": "*u8", "qt_ptr": "*u8", "K": "i32", "N": "i32"}, {"BLOCK": 128}, 8)
    yield (rows._scatter_rows_kernel,  # a capacity layout's rows (dropped copies write nothing)
           {"src_ptr": "*bf16", "row_id_map_ptr": "*i32", "weights_ptr": "*bf16", "dot_src_ptr": "*bf16",
            "out_ptr": "*bf16", "dots_ptr": "*bf16"},
           {"h": 2048, "K": 8, "K_PAD": 8, "HAS_WEIGHTS": False, "HAS_DOT": False, "DROPPED_WRITE": False,
            "BLOCK_H": 1024}, 4)
    for dt in ("bf16", "fp32"):
        yield (rows._scatter_rows_kernel,
               {"src_ptr": f"*{dt}", "row_id_map_ptr": "*i32", "weights_ptr": "*fp32", "dot_src_ptr": f"*{dt}",
                "out_ptr": f"*{dt}", "dots_ptr": "*fp32"},
               {"h": 2048, "K": 8, "K_PAD": 8, "HAS_WEIGHTS": True, "HAS_DOT": True, "DROPPED_WRITE": True,
                "BLOCK_H": 1024}, 4)
        yield (rows._gather_rows_kernel,
               {"src_ptr": f"*{dt}", "row_id_map_ptr": "*i32", "weights_ptr": "*fp32", "out_ptr": f"*{dt}"},
               {"h": 2048, "K": 8, "HAS_WEIGHTS": True, "BLOCK_H": 1024}, 4)
        yield (swiglu._swiglu_prob_fwd_kernel,
               {"x_ptr": f"*{dt}", "prob_ptr": "*fp32", "out_ptr": f"*{dt}", "N": "i32"},
               {"f": 768, "BLOCK_N": 8, "BLOCK_F": 256}, 4)
        yield (swiglu._swiglu_prob_bwd_kernel,
               {"x_ptr": f"*{dt}", "prob_ptr": "*fp32", "grad_out_ptr": f"*{dt}", "grad_x_ptr": f"*{dt}",
                "grad_prob_ptr": "*fp32", "N": "i32"},
               {"f": 768, "BLOCK_N": 4, "BLOCK_F": 256}, 4)
    for dt, write_grad in (("bf16", True), ("bf16", False), ("fp32", True)):
        yield (ce._ce_rows_kernel, {"logits_ptr": f"*{dt}", "labels_ptr": "*i64", "loss_ptr": "*fp32"},
               {"V": 151936, "WRITE_GRAD": write_grad, "IGNORE": ce.IGNORE_INDEX, "BLOCK_V": 4096}, 8)
    for dt in ("bf16", "fp32"):
        yield (ce._ce_slice_stats_kernel,
               {"logits_ptr": f"*{dt}", "local_labels_ptr": "*i64", "stats_ptr": "*fp32", "C": "i32"},
               {"V": 75968, "BLOCK_V": 4096}, 8)
        yield (ce._ce_slice_grad_kernel, {"logits_ptr": f"*{dt}", "local_labels_ptr": "*i64", "lse_ptr": "*fp32"},
               {"V": 75968, "BLOCK_V": 4096}, 8)
    for write_rows in (False, True):
        yield (permute._slot_kernel,
               {"indices_ptr": "*i64", "block_counts_ptr": "*i32", "block_base_ptr": "*i32", "row_id_map_ptr": "*i32",
                "T": "i32", "E": "i32"},
               {"K": 8, "K_PAD": 8, "BLOCK_T": 64, "BLOCK_E": 16, "WRITE_ROWS": write_rows}, 4)
    yield (permute._scan_kernel,
           {"block_counts_ptr": "*i32", "block_base_ptr": "*i32", "tokens_per_expert_ptr": "*i32",
            "offsets_ptr": "*i32", "n_blocks": "i32", "E": "i32"},
           {"B_PAD": 256, "CHUNK": 32}, 4)
    for sigmoid in (False, True):
        yield (router._router_kernel,
               {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "indices_ptr": "*i64",
                "count_partial_ptr": "*i32", "prob_partial_ptr": "*fp32", "T": "i32", "E": "i32",
                "scaling_factor": "fp32"},
               {"K": 8, "K_PAD": 8, "E_PAD": 128, "BLOCK_T": 32, "SIGMOID": sigmoid, "HAS_BIAS": True,
                "NORMALISE": True, "EPS": 1e-20}, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        raise SystemExit("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    target = GPUTarget("cuda", args.arch, 32)
    for kernel, signature, constexprs, num_warps in _variants():
        fn = _jit_function(kernel)
        start = time.perf_counter()
        src = ASTSource(fn, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs)
        triton.compile(src, target=target, options={"num_warps": num_warps})
        print(f"sm_{args.arch} {fn.__name__} {constexprs}: ok ({time.perf_counter() - start:.1f}s)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
