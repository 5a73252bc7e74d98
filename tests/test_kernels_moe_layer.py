"""The MoE layer with its Triton data path (`model.moe_kernels`) computes, and differentiates, what the torch path does.

The kernels run on CUDA when there is a GPU, else in Triton's CPU interpreter; the torch path is the one
`tests/test_moe_layer.py` checks against a per-token reference. fp32 throughout; tolerances rtol 1e-4 / atol 1e-5 (the
same sums in another order, and the fused activation folds the weight in fp32 where torch rounds it to x's dtype).
"""

import copy

import pytest
import torch
from kernels_interpreter import DEVICE, ON_CUDA, kernels_on_device  # noqa: F401  (first: before triton is imported)

from services.common.config import ModelConfig
from services.trainer.model.moe.moe_layer import MoELayer

ALL_KERNELS = ["permutation", "activation", "router"]


def make_layers(moe_kernels, **overrides):
    """(layer on the kernels, the same weights on the torch path), both fp32 on DEVICE."""
    fields = {"hidden_size": 16, "num_experts": 6, "top_k": 2, "moe_ffn_hidden_size": 12, "aux_loss_coeff": 0.01}
    fused = MoELayer(ModelConfig(**{**fields, **overrides, "moe_kernels": moe_kernels}))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        fused.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, 6))
    plain = MoELayer(ModelConfig(**{**fields, **overrides, "moe_kernels": []}))
    plain.load_state_dict(copy.deepcopy(fused.state_dict()))
    return fused.to(DEVICE), plain.to(DEVICE)


def run(layer, x, g):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    layer.router.tokens_per_expert.zero_()
    out = layer(x)
    (out * g).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}, layer.router.tokens_per_expert.clone()


CASES = {
    "softmax_dropless": {},
    "sigmoid_scaled_with_shared_expert": {"score_func": "sigmoid", "routed_scaling_factor": 2.5,
                                          "shared_expert_ffn_hidden_size": 8, "z_loss_coeff": 0.001},
    "capacity_drops": {"capacity_factor": 0.5},
    "sequence_aux_loss": {"aux_loss_type": "sequence"},
    "global_aux_loss": {"aux_loss_type": "global", "z_loss_coeff": 0.001},  # the Triton router's counts and means
    "pad_to_capacity": {"capacity_factor": 0.5, "pad_to_capacity": True},  # the permute kernels' capacity blocks
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("moe_kernels", [ALL_KERNELS, ["permutation"], ["activation"]])
def test_kernel_path_matches_the_torch_path_forward_gradients_and_load(case, moe_kernels):
    fused, plain = make_layers(moe_kernels, **CASES[case])
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(13, 16, generator=gen).to(DEVICE), torch.randn(13, 16, generator=gen).to(DEVICE)
    segment_ids = torch.tensor([0] * 5 + [1] * 8, device=DEVICE)
    got, want = run(fused, x, g), run(plain, x, g)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    assert torch.equal(got[3], want[3])  # the load the aux-free bias update reads
    # the per-sequence aux loss reads segment ids; the kernels must not change it
    fused.train(), plain.train()
    torch.testing.assert_close(fused.router(x, segment_ids).aux_loss, plain.router(x, segment_ids).aux_loss)


def test_the_kernels_are_what_runs_when_chosen():
    fused, _ = make_layers(ALL_KERNELS)
    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    routing = fused.router(x)
    assert type(routing.weights.grad_fn).__name__ == "_RouterFunctionBackward"
    dispatched = fused.dispatcher.dispatch(x, routing)
    assert type(dispatched.hidden.grad_fn).__name__ == "_PermuteFunctionBackward"
    assert dispatched.hidden.shape[0] == 5 * 2  # the fixed T·k-row buffer
    out = fused.dispatcher.combine(dispatched.hidden, dispatched)
    assert type(out.grad_fn).__name__ == "_UnpermuteFunctionBackward"


@pytest.mark.parametrize("recompute_dispatch", [False, True], ids=["", "recompute_moe_dispatch"])
def test_pad_to_capacity_runs_the_permute_kernels_into_capacity_blocks(recompute_dispatch):
    """Pad-to-capacity on the kernels: E·capacity rows from the Triton permutation (rebuilt by its data pass alone
    under `model.recompute: [moe_dispatch]`), the same output and gradients as the torch path's padded rows."""
    fused, plain = make_layers(["permutation"], capacity_factor=0.5, pad_to_capacity=True)
    for layer in (fused, plain):
        layer.recompute_dispatch = recompute_dispatch
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(13, 16, generator=gen).to(DEVICE), torch.randn(13, 16, generator=gen).to(DEVICE)
    routing = fused.router(x)
    dispatched = fused.dispatcher.dispatch(x, routing)
    assert type(dispatched.hidden.grad_fn).__name__ == "_PermuteFunctionBackward"
    assert dispatched.hidden.shape[0] == 6 * routing.capacity
    got, want = run(fused, x, g), run(plain, x, g)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


@pytest.mark.skipif(not ON_CUDA, reason="host-device synchronisation exists only with a CUDA device")
def test_the_dropless_forward_and_backward_never_wait_for_the_device():
    fused, _ = make_layers(ALL_KERNELS, hidden_size=64, moe_ffn_hidden_size=32)
    x = torch.randn(256, 64, device=DEVICE, requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):  # how training runs the grouped GEMMs
            out = fused(x)
        out.float().sum().backward()

    step()  # first call: Triton autotuning benchmarks (and syncs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
