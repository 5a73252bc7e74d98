"""One attention layer, forward + backward, at DeepSeek-V3's shape: Multi-head Latent Attention as the model runs it
(services/trainer/model/mla.py) against the GQA stand-in configs/deepseek_v3.yaml used before MLA existed (128 query
heads of 128, 16 key/value heads), on the same packed batch.

    python bench/bench_attention.py [--config configs/deepseek_v3.yaml] [--tokens 8192] [--seq-len 4096]

Rows: the whole layer (projections, RoPE, core, output projection) and its attention core alone (varlen flash
attention; MLA's values, narrower than its queries and keys, are zero-padded to their width: attention.py says why),
device milliseconds per forward + backward (`bench_kernels.time_ms`), the useful TFLOP/s (the projections' 6·params
per token plus the core's causal score and value GEMMs, Σ over documents of 3·heads·(d_qk + d_v)·len², padding not
counted), and the peak memory of one forward + backward above what was allocated before it. bf16 parameters, bf16
autocast, documents of random lengths packed into sequences of `--seq-len`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms  # noqa: E402
from bench.bench_train_step import synthetic_batch  # noqa: E402
from bench.record import Table, add_record_argument  # noqa: E402
from services.common.config import ModelConfig, load_config  # noqa: E402
from services.trainer.metrics import attention_params  # noqa: E402
from services.trainer.model.attention import Attention, packed_causal_attention  # noqa: E402
from services.trainer.model.mla import MLAttention  # noqa: E402


def gqa_stand_in(cfg: ModelConfig) -> ModelConfig:
    """The GQA layer configs/deepseek_v3.yaml described before MLA: the query side's 128 heads of 128, 16 KV heads."""
    gqa = copy.deepcopy(cfg)
    gqa.attention, gqa.head_dim, gqa.num_kv_heads = "gqa", 128, 16
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        setattr(gqa, name, 0)
    return gqa


def core_flops(cfg: ModelConfig, lengths: list[int]) -> float:
    """The causal score and value GEMMs, forward + backward, of `lengths`' documents (no padding counted)."""
    return 3.0 * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim) * sum(n * n for n in lengths)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(name: str, cfg: ModelConfig, batch: dict, lengths: list[int], reps: int, table: Table) -> None:
    dev = batch["cu"].device
    layer = (MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)).to(dev, torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.ndim > 1 else torch.nn.init.ones_(p)
    T, pos, cu, max_len = batch["x"].shape[0], batch["pos"], batch["cu"], max(lengths)
    x = batch["x"].clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        q, k, v = (t.detach().requires_grad_() for t in layer.qkv(x, pos))
    grad_core = torch.randn(T, q.shape[1], v.shape[-1], device=dev, dtype=torch.bfloat16)

    def whole():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x, pos, cu, max_len)
        out.backward(batch["grad"])

    def core():
        out = packed_causal_attention(q, k, v, cu, max_len)
        torch.autograd.grad(out, (q, k, v), grad_core)

    attn = core_flops(cfg, lengths)
    for row, fn, flops in ((f"{name}: layer", whole, 6.0 * attention_params(cfg) * T + attn),
                           (f"{name}: core", core, attn)):
        ms = time_ms(fn, warmup=3, reps=reps)
        table.line(f"{row:<28} {ms:9.3f} {flops / ms / 1e9:9.0f} {peak_mib(fn):10.0f}")
    del layer, q, k, v
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/deepseek_v3.yaml")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    add_record_argument(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention times the CUDA attention path (varlen flash attention) and needs a GPU")
    cfg = load_config(args.config).model
    if cfg.attention != "mla":
        raise SystemExit(f"{args.config} has model.attention={cfg.attention}; this bench compares an MLA config "
                         "with its GQA stand-in")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    packed = synthetic_batch(args.seq_len, args.tokens // args.seq_len, cfg.vocab_size, gen)
    cu = packed["cu_seqlens"]
    lengths = (cu[1:] - cu[:-1]).tolist()
    T = int(cu[-1])
    batch = {"x": torch.randn(T, cfg.hidden_size, device=dev, dtype=torch.bfloat16),
             "grad": torch.randn(T, cfg.hidden_size, device=dev, dtype=torch.bfloat16),
             "pos": packed["position_ids"].to(dev), "cu": cu.to(dev)}
    table = Table()
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.config} hidden "
               f"{cfg.hidden_size}, {cfg.num_heads} heads | {T} tokens in {len(lengths)} documents "
               f"(longest {max(lengths)}) | bf16")
    table.line(f"{'fwd+bwd':<28} {'ms':>9} {'TFLOP/s':>9} {'peak MiB':>10}")
    measure("MLA", cfg, batch, lengths, args.reps, table)
    measure("GQA 128/16 x 128", gqa_stand_in(cfg), batch, lengths, args.reps, table)
    table.record(args.record, "One attention layer, MLA vs the GQA stand-in, at DeepSeek-V3's shape")


if __name__ == "__main__":
    main()
