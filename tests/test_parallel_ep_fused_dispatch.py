"""The all-to-all expert-parallel dispatcher over the Triton permutation (`model.moe_kernels: [permutation]`, on CUDA)
computes what the torch permutation computes, dropless, with dropped copies (capacity factor) and padded to capacity
(`model.pad_to_capacity`: the Triton permutation into capacity blocks), and what one process with every expert
computes.

Two gloo ranks on CPU run the kernels in Triton's CPU interpreter (on a CUDA machine their own tests run them; these
ranks then take the torch path both ways). Each rank feeds its own tokens to the same EP2 MoE layer twice, fused and
not, and a single process feeds both ranks' tokens to the whole layer. fp32: the paths differ only in summation order
(the fused combine sums a token's copies in fp32 and rounds once), so outputs and gradients agree to rtol 1e-5, atol
1e-6 (the experts' gradients against one process: atol 1e-5, see below).
"""

import pytest
import torch
from kernels_interpreter import ON_CUDA, interpreted_gloo_rank  # first: before triton is imported
from parallel_harness import spawn_ranks, tiny_config

from services.trainer.model.moe.moe_layer import MoELayer

T = 12  # tokens per rank


def _layer_config(capacity_factor: float, pad: bool = False):
    cfg = tiny_config(ep=2)
    cfg.model.num_experts, cfg.model.top_k = 4, 2
    cfg.model.capacity_factor, cfg.model.pad_to_capacity = capacity_factor, pad
    cfg.model.aux_loss_coeff = 0.0
    cfg.model.moe_kernels = ["permutation"]
    return cfg


def _whole_layer(cfg) -> MoELayer:
    """The layer with every expert, its parameters drawn from one seed (the ranks keep their experts' slices)."""
    layer = MoELayer(cfg.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _inputs(rank: int, hidden: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(T, hidden, generator=g), torch.randn(T, hidden, generator=g)  # x, the output's cotangent


def _run(layer: MoELayer, x: torch.Tensor, cotangent: torch.Tensor) -> dict:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(cotangent)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads}


def _worker(rank, world, capacity_factor, pad, out_dir):
    with interpreted_gloo_rank(rank, world, out_dir):
        import kernels.permute
        from services.trainer.parallel.expert_parallel import apply_expert_parallel
        from services.trainer.parallel.groups import init_groups

        cfg = _layer_config(capacity_factor, pad)
        holder = torch.nn.ModuleDict({"moe": _whole_layer(cfg)})
        apply_expert_parallel(holder, init_groups(cfg))
        layer = holder["moe"]
        calls = []
        permute = kernels.permute.permute
        kernels.permute.permute = lambda *a, **k: calls.append(1) or permute(*a, **k)
        x, cotangent = _inputs(rank, cfg.model.hidden_size)
        runs = {}
        for fused in (True, False):
            layer.dispatcher.fused = fused
            runs[fused] = _run(layer, x, cotangent)
        torch.save({"runs": runs, "fused_calls": len(calls)}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("capacity_factor, pad", [(0.0, False), (0.75, False), (0.75, True)],
                         ids=["dropless", "capacity", "pad_to_capacity"])
def test_ep2_all_to_all_over_the_fused_permutation_matches_torch_and_one_process(tmp_path, capacity_factor, pad):
    cfg = _layer_config(capacity_factor, pad)
    whole = _whole_layer(cfg)
    inputs = [_inputs(r, cfg.model.hidden_size) for r in range(2)]
    # One process, both ranks' tokens. With a capacity factor each rank decides drops over its own tokens (the router
    # runs before the dispatch), so the reference routes the two ranks' tokens one rank at a time.
    ref = [_run(whole, x, c) for x, c in inputs]
    ranks = spawn_ranks(_worker, (2, capacity_factor, pad, str(tmp_path)), 2, str(tmp_path))
    for r, got in enumerate(ranks):
        assert got["fused_calls"] == (0 if ON_CUDA else 1)  # the Triton permutation ran once, in the fused run
        fused, plain = got["runs"][True], got["runs"][False]
        for key in ("out", "x_grad"):
            torch.testing.assert_close(fused[key], plain[key], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(fused[key], ref[r][key], rtol=1e-5, atol=1e-6)
        assert fused["grads"].keys() == plain["grads"].keys()
        for name in fused["grads"]:
            torch.testing.assert_close(fused["grads"][name], plain["grads"][name], rtol=1e-5, atol=1e-6)
    # The experts' gradients: each rank's half of the whole layer's, summed over the two ranks' tokens. The reference
    # adds two per-rank GEMMs; an EP rank runs one over both ranks' rows: fp32 sums in another order (seen: 1.4e-6 on
    # an element of 0.013), hence atol 1e-5 here.
    for name in ("experts.w13", "experts.w2"):
        whole_grad = sum(run["grads"][name] for run in ref)
        got = torch.cat([ranks[r]["runs"][True]["grads"][name] for r in range(2)])
        torch.testing.assert_close(got, whole_grad, rtol=1e-5, atol=1e-5)
