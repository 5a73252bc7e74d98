"""Selective recompute and activation offload (`model.recompute`, `model.offload`) change what is kept for backward,
never the result: gradients equal those of the plain model, and the bytes of tensors saved for backward in device
memory shrink. Saved bytes are counted by saved-tensor hooks around the whole forward (each storage once); tensors a
recomputed or offloaded region keeps elsewhere never reach those hooks, which is the point."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from services.common.config import ConfigError, ModelConfig, load_config
from services.trainer.model.recompute import apply_memory_policy, discard_output, dropping_discarded, in_recompute
from services.trainer.model.transformer import MoETransformer

CFG = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2, moe_ffn_hidden_size=24,
           shared_expert_ffn_hidden_size=16, ffn_hidden_size=48, first_k_dense=1, aux_loss_coeff=0.01)
T = 24


def batch():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 264, (T,), generator=gen)
    cu_seqlens = torch.tensor([0, 10, 24], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(10), torch.arange(14)])
    return tokens, position_ids, cu_seqlens


def train_step(model):
    """(loss, gradients by name, bytes of distinct storages saved for backward, router load)."""
    device = next(model.parameters()).device
    tokens, position_ids, cu_seqlens = (t.to(device) for t in batch())
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, position_ids, cu_seqlens)
        loss = torch.nn.functional.cross_entropy(logits, torch.roll(tokens, -1))
    loss.backward()
    load = torch.stack([m.router.tokens_per_expert for m in model.moe_layers()])
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(storages.values()), load


def models(recompute=(), offload=(), recompute_layers=(), offload_layers=(), num_layers=2):
    plain = MoETransformer(ModelConfig(**{**CFG, "num_layers": num_layers}))
    plain.init_weights(0)
    policy = copy.deepcopy(plain)
    return plain, apply_memory_policy(policy, list(recompute), list(offload), list(recompute_layers),
                                      list(offload_layers))


def freed_after_forward(model) -> tuple[bool, bool]:
    """Run one forward of `model` and report, before its backward, whether its first MoE layer's dispatched rows and
    gate/up rows are gone (nothing holds them once the saved-tensor recipes replaced them); then run the backward."""
    experts = model.moe_layers()[0].experts
    rows, gate_up = [], []
    original_forward, original_activation = experts.forward, experts._activation
    experts.forward = lambda x, *a: rows.append(weakref.ref(x)) or original_forward(x, *a)
    experts._activation = lambda h13, w: gate_up.append(weakref.ref(h13)) or original_activation(h13, w)
    device = next(model.parameters()).device
    try:
        logits = model(*(t.to(device) for t in batch()))
        gc.collect()
        freed = (all(r() is None for r in rows), bool(gate_up) and all(r() is None for r in gate_up))
        logits.sum().backward()
    finally:
        del experts.forward, experts._activation
    return freed


def assert_same_step(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-6, atol=1e-7, msg=f"gradient of {name}")
    assert torch.equal(got[3], want[3]), "the router load must be counted once per step, recompute or not"


@pytest.mark.parametrize("recompute", [["norm"], ["attn_core"], ["moe_act"], ["moe_fc1"], ["moe_dispatch"], ["moe"],
                                       ["layer"], ["norm", "attn_core", "moe_act"], ["moe_dispatch", "moe_act"],
                                       ["moe_fc1", "moe_act"], ["moe_dispatch", "moe_fc1", "moe_act"]])
def test_recompute_keeps_gradients_and_shrinks_saved_activations(recompute):
    plain, policy = models(recompute=recompute)
    want, got = train_step(plain), train_step(policy)
    assert_same_step(got, want)
    assert got[2] < want[2], f"{recompute}: saved {got[2]} bytes, plain model {want[2]}"


@pytest.mark.parametrize("offload", [["attn"], ["moe"], ["layer"], ["attn", "moe"]])
def test_offload_keeps_gradients_and_moves_saved_activations_off_the_device(offload):
    plain, policy = models(offload=offload)
    want, got = train_step(plain), train_step(policy)
    assert_same_step(got, want)
    assert got[2] < want[2], f"{offload}: {got[2]} bytes left on the device, plain model {want[2]}"


def test_recompute_and_offload_combine():
    plain, policy = models(recompute=["norm", "moe_act"], offload=["attn"])
    want, got = train_step(plain), train_step(policy)
    assert_same_step(got, want)
    assert got[2] < train_step(models(recompute=["norm", "moe_act"])[1])[2]


@pytest.mark.parametrize("key", ["recompute", "offload"])
def test_the_policy_applies_to_the_listed_layers_only(key):
    """Per layer: recomputing/offloading one of three MoE layers keeps the gradients and saves less than doing all
    three, more than doing none."""
    kind = {"recompute": ["moe"], "offload": ["moe"]}[key]
    plain, one = models(**{key: kind, f"{key}_layers": [1]}, num_layers=3)
    _, every = models(**{key: kind}, num_layers=3)
    want, got, all_layers = train_step(plain), train_step(one), train_step(every)
    assert_same_step(got, want)
    assert all_layers[2] < got[2] < want[2], (all_layers[2], got[2], want[2])
    assert ["forward" in vars(block.mlp) for block in one.layers.values()] == [False, True, False]  # wrapped: layer 1


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_recomputed_dispatch_is_the_dispatch_and_frees_its_rows(capacity_factor):
    """`moe_dispatch`: the experts' first GEMM keeps no [T·k, h] rows (only the [T, h] input stays), the rows are
    permuted again once in backward, and every gradient is the plain layer's; dropless and with dropped copies."""
    plain = MoETransformer(ModelConfig(**{**CFG, "capacity_factor": capacity_factor}))
    plain.init_weights(0)
    policy = apply_memory_policy(copy.deepcopy(plain), ["moe_dispatch"], [])
    moe = policy.moe_layers()[0]
    rows, redispatched = [], []
    original_experts, original_redispatch = moe.experts.forward, moe.dispatcher.redispatch
    moe.experts.forward = lambda x, *a: rows.append((weakref.ref(x), x.detach().clone())) or original_experts(x, *a)
    moe.dispatcher.redispatch = lambda *a: redispatched.append(original_redispatch(*a)) or redispatched[-1]
    want, got = train_step(plain), train_step(policy)
    assert_same_step(got, want)
    (alive, dispatched), = rows
    assert len(redispatched) == 1 and torch.equal(redispatched[0], dispatched)
    saved_plain, saved_policy = want[2], got[2]
    assert saved_plain - saved_policy >= dispatched.untyped_storage().nbytes(), (saved_plain, saved_policy)
    # Freed, not just hidden from the saved-tensor count: nothing holds the rows between forward and backward.
    del moe.experts.forward, moe.dispatcher.redispatch
    rows_freed, _ = freed_after_forward(policy)
    assert rows_freed, "the dispatched rows outlived the forward pass"


@pytest.mark.parametrize("recompute", [["moe_fc1"], ["moe_dispatch", "moe_fc1"]])
def test_recomputed_gate_up_rows_are_freed_between_forward_and_backward(recompute):
    """`moe_fc1`: the activation's [T·k, 2f] input is not kept (the first grouped GEMM runs again in backward), also
    when it is rebuilt from rows the dispatch discarded too; gradients equal the plain model's."""
    plain, policy = models(recompute=recompute)
    want, got = train_step(plain), train_step(policy)
    assert_same_step(got, want)
    assert got[2] < train_step(models(recompute=[r for r in recompute if r != "moe_fc1"])[1])[2]
    rows_freed, gate_up_freed = freed_after_forward(policy)
    assert gate_up_freed, "the gate/up rows outlived the forward pass"
    # The rebuilt gate/up rows come from rebuilt dispatched rows, not from the dispatched rows kept alive.
    assert rows_freed == ("moe_dispatch" in recompute)


def test_recomputed_dispatch_on_the_triton_kernels_keeps_the_gradients(monkeypatch):
    """The same with the fused permutation and activation (on the GPU, or Triton's CPU interpreter): the rows are
    rebuilt from the kernel's row map."""
    from kernels_interpreter import DEVICE, ON_CUDA

    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    plain, policy = (m.to(DEVICE) for m in models(recompute=["moe_dispatch", "moe_fc1", "moe_act"]))
    assert "permutation" in plain.cfg.moe_kernels and "activation" in plain.cfg.moe_kernels
    want, got = train_step(plain), train_step(policy)
    assert_same_step(got, want)
    assert got[2] < want[2]
    assert freed_after_forward(policy) == (True, True), "the dispatched or gate/up rows outlived the forward pass"


def test_a_discarded_output_is_rebuilt_once_for_all_its_consumers_in_backward():
    calls = []
    x = torch.randn(4, 3, requires_grad=True)
    w1, w2 = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)

    def rebuild():
        calls.append(1)
        return torch.tanh(x)

    y = discard_output(torch.tanh(x), rebuild)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with dropping_discarded():
            out = (y @ w1).sum() + (y @ w2).sum()
    assert not any(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in saved)
    out.backward()
    assert len(calls) == 1
    torch.testing.assert_close(w1.grad, torch.tanh(x).detach().T @ torch.ones(4, 5))


def test_in_recompute_is_true_only_while_backward_reruns_a_checkpointed_forward():
    seen = []
    plain, policy = models(recompute=["moe"])
    moe = policy.moe_layers()[0]
    original = moe.experts.forward

    def spy(*args):
        seen.append(in_recompute())
        return original(*args)

    moe.experts.forward = spy
    train_step(policy)
    assert seen == [False, True]


@pytest.mark.parametrize("override,message", [
    ("model.recompute=[mlp]", "unknown entries"),
    ("model.offload=[norm]", "unknown entries"),
    ("model.recompute=[layer,norm]", "already recomputes"),
    ("model.recompute=[moe,moe_act]", "already recomputes"),
    ("model.recompute=[moe,moe_dispatch]", "already recomputes"),
    ("model.recompute=[layer,moe_fc1]", "already recomputes"),
    ("model.recompute=[moe_dispatch] parallel.ep=2", "move them between ranks"),
    ("model.recompute=[moe_dispatch] parallel.etp=2", "move them between ranks"),
    ("model.moe_kernels=[gemm]", "unknown entries"),
    ("model.recompute=[moe] model.recompute_layers=[0,9]", r"names layers \[9\], outside 0..3"),
    ("model.offload=[attn] model.offload_layers=[1,1]", "lists a layer twice"),
    ("model.recompute_layers=[1]", "which is empty"),
])
def test_config_rejects_what_it_cannot_apply(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())
