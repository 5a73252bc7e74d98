"""bench/trace_summary.py: the interval arithmetic behind exposed-communication time, and the kernel-name classifier."""

import pytest

from bench.trace_summary import (COMPUTE_CATEGORIES, OTHER_COMPUTE, comm_category, compute_category, exposed_length,
                                 intersection_length, summarize, total_length, union)


def test_union_merges_overlapping_nested_and_touching_intervals_and_drops_empty_ones():
    assert union([(5, 7), (0, 2), (1, 3), (10, 20), (12, 15), (7, 8), (30, 30), (40, 39)]) == [(0, 3), (5, 8), (10, 20)]
    assert union([]) == []


@pytest.mark.parametrize("intervals, length", [
    ([], 0.0),
    ([(0, 2), (3, 4)], 3.0),                 # disjoint
    ([(0, 2), (1, 3)], 3.0),                 # overlapping: the overlap counts once
    ([(0, 10), (2, 3), (4, 6)], 10.0),       # nested
    ([(1, 1), (2, 5), (2, 5)], 3.0),         # empty and duplicate
])
def test_total_length_counts_covered_time_once(intervals, length):
    assert total_length(intervals) == length


@pytest.mark.parametrize("a, b, both", [
    ([], [(0, 5)], 0.0),                                  # empty
    ([(0, 2)], [(3, 5)], 0.0),                            # disjoint
    ([(0, 2)], [(2, 5)], 0.0),                            # touching
    ([(0, 4)], [(2, 6)], 2.0),                            # overlapping
    ([(0, 10)], [(1, 2), (4, 7)], 4.0),                   # nested, several pieces
    ([(0, 3), (5, 9)], [(2, 6), (8, 20)], 3.0),           # interleaved: [2,3] + [5,6] + [8,9]
    ([(0, 4), (1, 5)], [(3, 6), (3, 6)], 2.0),            # overlaps within each side counted once
])
def test_intersection_length_is_the_time_both_unions_cover(a, b, both):
    assert intersection_length(a, b) == both
    assert intersection_length(b, a) == both


def test_exposed_length_is_comm_time_with_no_compute_running():
    compute = [(0, 10), (20, 30)]
    assert exposed_length([(5, 25)], compute) == 10.0           # runs 5-25, hidden in 5-10 and 20-25
    assert exposed_length([(2, 8)], compute) == 0.0             # fully hidden
    assert exposed_length([(10, 20)], compute) == 10.0          # fully exposed, touching both sides
    assert exposed_length([(12, 14), (13, 18)], compute) == 6.0  # overlapping comm kernels count once
    assert exposed_length([], compute) == 0.0
    assert exposed_length([(0, 4)], []) == 4.0


@pytest.mark.parametrize("name, cat", [
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all_to_all"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "all_reduce"),
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "other"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", None),
])
def test_comm_category_names_the_collective_of_nccl_kernels_only(name, cat):
    assert comm_category(name) == cat


@pytest.mark.parametrize("name, cat", [
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm90<cutlass::gemm::kernel::GemmUniversal<"
     "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, ...> > >(...)", "expert GEMM"),
    ("_fp8_grouped_mm_kernel", "expert GEMM"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "dense GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
     "dense GEMM"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", "dense GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8>(...)", "dense GEMM"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t> >(...)",
     "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, ...>(...)", "optimizer"),
    ("Memcpy DtoH (Device -> Pinned)", "memcpy/memset"),
    ("Memset (Device)", "memcpy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>(...)",
     OTHER_COMPUTE),
    ("_swiglu_prob_fwd_kernel", OTHER_COMPUTE),
])
def test_compute_category_classifies_kernel_names_and_sends_unknown_ones_to_other(name, cat):
    assert compute_category(name) == cat


def test_summarize_splits_one_ranks_kernels_into_comm_exposed_compute_and_busy():
    kernels = [
        ("nvjet_tst_gemm", 0, 10),                                  # dense GEMM 0-10
        ("cutlass GroupProblemShape grouped", 8, 12),               # expert GEMM 8-12
        ("ncclDevKernel_SendRecv", 5, 15),                          # all_to_all: hidden 5-12, exposed 12-15
        ("ncclDevKernel_SendRecv", 14, 16),                         # overlaps the previous one: exposed 15-16 more
        ("ncclDevKernel_AllReduce_Sum_f32", 20, 30),                # all_reduce: hidden 25-30 under the optimizer
        ("multi_tensor_apply_kernel", 25, 35),                      # optimizer 25-35
    ]
    s = summarize(kernels + [kernels[2]])  # the profiler may report a kernel twice: it counts once
    assert s["comm"] == {"all_to_all": 11.0, "all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 10.0,
                         "other": 0.0}
    assert s["exposed"] == {"all_to_all": 4.0, "all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 5.0,
                            "other": 0.0, "total": 9.0}
    assert set(s["compute"]) == set(COMPUTE_CATEGORIES)
    assert s["compute"]["dense GEMM"] == 10.0 and s["compute"]["expert GEMM"] == 4.0
    assert s["compute"]["optimizer"] == 10.0 and s["compute"][OTHER_COMPUTE] == 0.0
    assert s["device"] == {"busy": 31.0, "comm": 21.0, "compute": 22.0}  # idle: 16-20 only, in 0-35


def test_summarize_counts_concurrent_collectives_exposed_each_but_once_in_total():
    s = summarize([("ncclDevKernel_SendRecv", 0, 10), ("ncclDevKernel_AllGather_RING", 5, 15), ("gemm", 0, 5)])
    assert s["exposed"]["all_to_all"] == 5.0 and s["exposed"]["all_gather"] == 10.0
    assert s["exposed"]["total"] == 10.0
