"""FP8 dense linears (services/trainer/model/fp8_linear.py, config `model.fp8`): Transformer Engine on CUDA, nn.Linear
exactly everywhere else, and the same parameters and state_dict either way.

CPU tests run in CI. The GPU tests need a CUDA GPU with FP8 tensor cores (Hopper) and transformer_engine; run them
there as `python -m pytest -q tests/test_model_fp8_dense.py`. Their tolerances (relative L2 against the bf16 path, fp32
master weights under bf16 autocast, the training setup): e4m3 operands round to ~2-3% rms each, so a forward GEMM lands
within ~4%: < 5% asserted; tensorwise gradients are e5m2 (TE's HYBRID format, ~5% rms), so dgrad and wgrad land within
~6%: < 8% asserted (blockwise, e4m3 throughout, is inside the same bounds).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.common.config import ConfigError, ModelConfig, load_config
from services.trainer.model import fp8_linear
from services.trainer.model.fp8_linear import FP8Linear
from services.trainer.model.transformer import MoETransformer

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("tensorwise", "blockwise")


def tiny_cfg(fp8: str = "", **over) -> ModelConfig:
    """Every dense linear kind: attention, a dense first layer, MoE layers with a shared expert."""
    base = dict(vocab_size=264, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                first_k_dense=1, num_experts=4, top_k=2, moe_ffn_hidden_size=32, shared_expert_ffn_hidden_size=48,
                moe_kernels=[], fp8=fp8)
    base.update(over)
    return ModelConfig(**base)


def packed_batch(T: int, vocab: int, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [T // 3, T // 2, T - T // 3 - T // 2]
    tokens = torch.randint(0, vocab, (T,), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return {k: v.to(device) for k, v in dict(tokens=tokens, position_ids=pos, cu_seqlens=cu,
                                              labels=torch.roll(tokens, -1)).items()}


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], batch["position_ids"], batch["cu_seqlens"], labels=batch["labels"])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def fresh_te_import():
    """`_import_te` caches its answer per process: clear it around a test that changes what imports."""
    fp8_linear._import_te.cache_clear()
    yield
    fp8_linear._import_te.cache_clear()


def block_transformer_engine(monkeypatch):
    """`import transformer_engine.pytorch` raises ModuleNotFoundError (None in sys.modules), installed or not."""
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)


# ---------------------------------------------------------------- CPU (CI)


def test_module_imports_and_model_runs_with_fp8_set_when_transformer_engine_cannot_import():
    # A fresh interpreter in which `import transformer_engine` fails, whether or not it is installed on this machine.
    code = textwrap.dedent("""
        import sys
        sys.modules["transformer_engine"] = sys.modules["transformer_engine.pytorch"] = None
        import torch
        from services.trainer.model import fp8_linear
        from services.trainer.model.transformer import MoETransformer
        from tests.test_model_fp8_dense import packed_batch, tiny_cfg
        te, why = fp8_linear._import_te()
        assert te is None and "transformer_engine" in why, why
        model = MoETransformer(tiny_cfg("tensorwise"))
        model.init_weights(0)
        b = packed_batch(37, 264)
        loss = model(b["tokens"], b["position_ids"], b["cu_seqlens"], labels=b["labels"])
        loss.backward()
        assert torch.isfinite(loss)
        print("ran on cpu without transformer_engine")
    """)
    # CUDA hidden: this is the CPU-only machine (CI), where fp8 must leave the model on its torch path.
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ran on cpu without transformer_engine" in out.stdout


def test_importing_the_model_does_not_import_transformer_engine():
    code = ("import sys; import services.trainer.model.transformer, services.trainer.model.fp8_linear; "
            "print('te imported' if 'transformer_engine' in sys.modules else 'te not imported')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "te not imported"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.usefixtures("as_on_a_cpu_machine")
def test_fp8_on_cpu_gives_exactly_the_unset_models_loss_and_gradients(recipe):
    plain, fp8 = MoETransformer(tiny_cfg("")), MoETransformer(tiny_cfg(recipe))
    plain.init_weights(0)
    fp8.load_state_dict(plain.state_dict())
    batch = packed_batch(37, 264)  # 37 tokens: not a multiple of 16, which the CUDA path pads
    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(plain, batch), loss_and_grads(fp8, batch)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == len(list(plain.parameters()))
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.usefixtures("as_on_a_cpu_machine")
def test_dense_linears_keep_nn_linear_names_shapes_and_state_dict_keys():
    plain, fp8 = MoETransformer(tiny_cfg("")), MoETransformer(tiny_cfg("tensorwise"))
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(plain) == shapes(fp8)
    assert not any("_extra_state" in k for k in fp8.state_dict())
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in fp8.named_parameters()]
    dense = [m for m in fp8.modules() if isinstance(m, FP8Linear)]
    # per layer q/k/v/o; the dense layer's gate/up/down; each MoE layer's shared expert gate/up/down
    assert len(dense) == 3 * 4 + 3 + 2 * 3
    assert all(isinstance(m, torch.nn.Linear) and m.fp8 == "tensorwise" and m.bias is None for m in dense)
    assert not isinstance(fp8.output, FP8Linear)  # the output layer stays in higher precision


def test_cuda_without_transformer_engine_fails_at_model_build_naming_cause_and_fix(monkeypatch, fresh_te_import):
    # Nothing is run on a device here: the build asks `torch.cuda.is_available()` (shimmed: "this machine has CUDA")
    # and imports transformer_engine (made to fail for real by a None entry in sys.modules).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    block_transformer_engine(monkeypatch)
    with pytest.raises(RuntimeError, match=r"(?s)model\.fp8=tensorwise.*transformer_engine.*does not import.*"
                                           r"pip install.*transformer-engine.*model\.fp8=''"):
        MoETransformer(tiny_cfg("tensorwise"))
    MoETransformer(tiny_cfg(""))  # without fp8 the same machine needs no Transformer Engine


def test_cpu_only_machine_builds_fp8_model_without_transformer_engine(monkeypatch, fresh_te_import):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    block_transformer_engine(monkeypatch)
    MoETransformer(tiny_cfg("blockwise"))


@pytest.mark.usefixtures("as_on_a_cpu_machine")
def test_a_copied_layer_does_not_share_the_original_layers_transformer_engine_module():
    layer = FP8Linear(16, 16, fp8="tensorwise")
    marker = object()
    layer._te.module = marker  # what a CUDA forward leaves there: a TE Linear bound to `layer.weight`
    twin = copy.deepcopy(layer)
    assert twin._te.module is None and layer._te.module is marker  # rebuilt for (and bound to) the copy's weight
    assert twin.weight is not layer.weight and torch.equal(twin.weight, layer.weight)


def test_fp8_linear_rejects_an_unknown_recipe():
    with pytest.raises(ValueError, match="model.fp8=rowwise"):
        FP8Linear(16, 16, fp8="rowwise")


@pytest.mark.parametrize("overrides, names", [
    (["model.head_dim=6"], "`model.num_heads` x head dim (the q/o projections) = 24 / `parallel.tp=1`"),
    (["model.num_heads=8", "model.num_kv_heads=1", "model.head_dim=8"],
     "`model.num_kv_heads` x head dim (the k/v projections) = 8 / `parallel.tp=1`"),
    (["model.first_k_dense=1", "model.ffn_hidden_size=200"], "`model.ffn_hidden_size` = 200 / `parallel.tp=1`"),
    (["model.shared_expert_ffn_hidden_size=72"], "`model.shared_expert_ffn_hidden_size` = 72 / `parallel.tp=1`"),
    (["parallel.tp=2", "model.first_k_dense=1", "model.ffn_hidden_size=48"],  # 24 per TP rank
     "`model.ffn_hidden_size` = 48 / `parallel.tp=2`"),
])
def test_config_rejects_dense_widths_fp8_cannot_run_and_names_them(overrides, names):
    for fp8 in RECIPES:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.fp8={fp8}", *overrides])
        assert f"`model.fp8={fp8}` runs the dense linears in FP8" in str(err.value)
        assert names in str(err.value) and "multiple of 16" in str(err.value) and "model.fp8=''" in str(err.value)
    load_config(None, overrides)  # the same sizes are fine without fp8


def test_config_ignores_the_dense_ffn_width_when_there_is_no_dense_layer():
    load_config(None, ["model.fp8=tensorwise", "model.first_k_dense=0", "model.ffn_hidden_size=200"])


# ---------------------------------------------------------------- GPU with Transformer Engine

ON_CUDA = torch.cuda.is_available()
gpu_te = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU (Hopper for FP8 tensor cores) and transformer_engine")


def _te():
    return pytest.importorskip("transformer_engine.pytorch")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear_run(fp8: str, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, bias: torch.Tensor | None = None):
    layer = FP8Linear(weight.shape[1], weight.shape[0], fp8=fp8, bias=bias is not None).cuda()
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    x = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    out.backward(dy)
    return layer, out, x.grad, layer.weight.grad, None if bias is None else layer.bias.grad


@gpu_te
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])  # Qwen2's q/k/v biases: added after the FP8 GEMM
@pytest.mark.parametrize("rows", [4096, 4093])  # 4093: not a multiple of 16, padded for TE and cut off again
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_fp8_linear_forward_and_grads_are_close_to_bf16(recipe, rows, bias):
    _te()
    g = torch.Generator(device="cuda").manual_seed(0)
    K, N = 2048, 1536  # Qwen3-30B-A3B-like hidden -> a projection width
    w = torch.randn(N, K, device="cuda", generator=g) * 0.02  # fp32 master weight, as in training
    x = torch.randn(rows, K, device="cuda", generator=g)
    dy = torch.randn(rows, N, device="cuda", generator=g, dtype=torch.bfloat16)
    b = torch.randn(N, device="cuda", generator=g) if bias else None  # as large as the outputs: a lost one shows
    layer, *got = _linear_run(recipe, w, x, dy, b)
    _, *want = _linear_run("", w, x, dy, b)
    assert layer._te.module is not None  # the TE path ran (not F.linear)
    assert got[0].dtype == want[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert not torch.equal(got[0], want[0])  # FP8 rounding shows: it really was not the bf16 GEMM
    for name, a, b, tol in zip(("out", "grad x", "grad w", "grad bias"), got, want, (0.05, 0.08, 0.08, 0.01)):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape, name
        assert _rel(a, b) < tol, (name, _rel(a, b))
    names = ["weight", "bias"] if bias else ["weight"]
    assert list(layer.state_dict()) == names  # no TE `_extra_state`, no TE submodule
    assert [n for n, _ in layer.named_parameters()] == names and list(layer.children()) == []


@gpu_te
def test_gpu_fp8_linear_follows_a_weight_replaced_in_place_by_tensor_parallel_sharding():
    _te()
    layer = FP8Linear(256, 128, fp8="tensorwise").cuda()
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x)
    # what tensor_parallel._shard_linear does: a new, smaller Parameter in place of `weight`
    layer.weight = torch.nn.Parameter(layer.weight.detach()[:64].clone())
    layer.out_features = 64
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert out.shape == (64, 64) and layer.weight.grad is not None and layer.weight.grad.shape == (64, 256)
    assert _rel(out, torch.nn.functional.linear(x.bfloat16(), layer.weight.bfloat16())) < 0.05


@gpu_te
@pytest.mark.parametrize("extra", [{}, {"qkv_bias": True, "shared_expert_gate": True}], ids=["", "qwen2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_moe_transformer_in_fp8_trains_a_step_with_a_loss_close_to_bf16(recipe, extra):
    _te()
    cfg = dict(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=512,
               first_k_dense=1, num_experts=8, top_k=2, moe_ffn_hidden_size=256, shared_expert_ffn_hidden_size=256,
               **extra)
    batch = packed_batch(2 * 512 + 5, 1024, device="cuda", seed=1)
    runs = {}
    for fp8 in ("", recipe):
        model = MoETransformer(ModelConfig(**cfg, fp8=fp8))
        model.init_weights(0)
        model.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            runs[fp8] = loss_and_grads(model, batch)
        dense = [m for m in model.modules() if isinstance(m, FP8Linear)]
        assert all((m._te.module is not None) == bool(fp8) for m in dense)
    (loss_bf16, grads_bf16), (loss_fp8, grads_fp8) = runs[""], runs[recipe]
    tokens = batch["tokens"].numel()
    assert loss_fp8 != loss_bf16
    assert abs(loss_fp8.item() - loss_bf16.item()) / loss_bf16.item() < 0.01, (loss_fp8 / tokens, loss_bf16 / tokens)
    assert grads_fp8.keys() == grads_bf16.keys()
    assert all(torch.isfinite(g).all() for g in grads_fp8.values())
