"""The dropless MoE layer never makes the host wait for the GPU (issue #8): per-expert counts and offsets stay on the
device, so the layer can run ahead of the GPU and under CUDA graphs. CUDA's sync debug mode turns every
device-to-host synchronisation into an error, forward and backward.

Not sync-free, by design: capacity-factor dropping on the torch path (`model.capacity_factor > 0` sizes its kept-token
buffer from a count) and the expert-parallel all-to-all (its split sizes are host integers for NCCL) — unless
`model.pad_to_capacity` gives every expert its capacity of rows, sizes the host knows (the all-to-all's part of that is
checked on a CPU too, tests/test_moe_pad_to_capacity.py).
"""

import pytest
import torch

from services.common.config import ModelConfig
from services.trainer.model.moe.moe_layer import MoELayer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="counts device-to-host syncs on a CUDA device")

CASES = {
    "torch_path": {"moe_kernels": []},
    "kernels": {"moe_kernels": ["permutation", "activation"]},
    "kernels_router_shared_expert_sequence_aux": {"moe_kernels": ["permutation", "activation", "router"],
                                                  "shared_expert_ffn_hidden_size": 64, "aux_loss_type": "sequence",
                                                  "z_loss_coeff": 1e-3},
    "sigmoid_groups_bias": {"moe_kernels": ["permutation", "activation"], "score_func": "sigmoid", "num_groups": 4,
                            "topk_groups": 2, "bias_update_rate": 1e-3},
    "capacity_padded": {"moe_kernels": ["permutation", "activation"], "capacity_factor": 1.0, "pad_to_capacity": True},
    "kernels_router_global_aux": {"moe_kernels": ["permutation", "activation", "router"], "aux_loss_type": "global",
                                  "z_loss_coeff": 1e-3},
}


def run_layer(cfg: ModelConfig) -> torch.Tensor:
    """Forward + backward once to warm up, then again with every device-to-host sync an error; x's gradient."""
    layer = MoELayer(cfg)
    with torch.no_grad():  # the model initialises its layers' weights (MoETransformer.init_weights), not the layer
        for w in layer.parameters():
            w.normal_(0.0, 0.05)
    layer.cuda()
    x = torch.randn(2048, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x).float().square().mean().backward()  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    x.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return x.grad


def config(**overrides) -> ModelConfig:
    return ModelConfig(hidden_size=256, num_experts=16, top_k=4, moe_ffn_hidden_size=128, aux_loss_coeff=1e-2,
                       **overrides)


@pytest.mark.parametrize("case", CASES)
def test_moe_layer_forward_and_backward_make_no_device_to_host_sync(case):
    grad = run_layer(config(**CASES[case]))
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_the_check_catches_a_sync():
    # Capacity dropping on the torch path sizes its buffer from a count on the host: the same check must fail there.
    with pytest.raises(RuntimeError, match="synchroniz"):
        run_layer(config(capacity_factor=1.0, moe_kernels=[]))


@pytest.mark.parametrize("case", ["kernels", "kernels_router_shared_expert_sequence_aux", "capacity_padded"])
def test_moe_layer_runs_under_a_cuda_graph_and_matches_eager(case):
    """What sync-free buys: the layer's forward and backward capture into CUDA graphs (make_graphed_callables) and
    replay to eager's output, input gradient and weight gradients (bf16 autocast; tolerance: atomic-add order)."""
    cfg = config(**CASES[case])
    eager = MoELayer(cfg)
    with torch.no_grad():
        for w in eager.parameters():
            w.normal_(0.0, 0.05)
    eager.cuda()
    graphed_layer = MoELayer(cfg).cuda()
    graphed_layer.load_state_dict(eager.state_dict())
    x = torch.randn(2048, 256, device="cuda")
    grad = torch.randn_like(x)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # graphs need autocast's cache off
        graphed = torch.cuda.make_graphed_callables(graphed_layer, (x.clone().requires_grad_(True),))
        for w in graphed_layer.parameters():  # the capture's warm-up iterations accumulated into them
            w.grad = None
        results = []
        for fn in (eager, graphed):
            xi = x.clone().requires_grad_(True)
            out = fn(xi)
            out.backward(grad)
            results.append((out.float(), xi.grad))
    torch.cuda.synchronize()
    (out_e, gx_e), (out_g, gx_g) = results
    torch.testing.assert_close(out_g, out_e, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gx_g, gx_e, rtol=2e-2, atol=2e-3)
    for (name, we), wg in zip(eager.named_parameters(), graphed_layer.parameters()):
        torch.testing.assert_close(wg.grad, we.grad, rtol=2e-2, atol=2e-3, msg=name)
