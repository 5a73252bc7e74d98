"""The MoE layer alone, forward + backward: foldmoe's MoELayer against the `transformers` sparse MoE blocks.

    python bench/bench_moe_layer.py [--tokens 16384] [--shapes qwen3_30b_a3b mixtral_8x7b] [--iters 10]

For each shape (the model's hidden size, experts, top-k and expert width, from configs/<shape>.yaml) it builds, on the
same random bf16 weights and input, and times a forward + backward of:
- foldmoe `MoELayer` as the trainer runs it (router in fp32, device-side permutation, `torch._grouped_mm` experts, the
  default `model.moe_kernels`), and with the kernels off (`moe_kernels=[]`, torch ops only);
- `transformers`' block (`Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`) with `experts_implementation="grouped_mm"`
  and with its default, a per-expert loop ("eager").
Rates count the expert GEMMs only (18·T·k·h·f FLOPs for a forward + backward of a SwiGLU expert), as the issue's
reference figures do, and are also given as a fraction of a dense bf16 GEMM measured in the same run. Outputs are
checked against foldmoe's (same weights, same routing: both renormalise the top-k softmax probabilities).
Needs `transformers` for the peer rows (skipped with a note when it is missing). On CPU, use tiny shapes (--cpu-smoke).
Prints one table; `--record bench/RESULTS.md` appends it there with machine, command and commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import Table, add_record_argument  # noqa: E402
from services.common.config import ModelConfig, load_config  # noqa: E402
from services.trainer.metrics import measure_peak_tflops  # noqa: E402
from services.trainer.model.moe.moe_layer import MoELayer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def shape_config(name: str, cpu_smoke: bool) -> ModelConfig:
    m = load_config(ROOT / "configs" / f"{name}.yaml").model
    if cpu_smoke:  # same structure, tiny sizes
        m.hidden_size, m.moe_ffn_hidden_size, m.num_experts = 64, 32, min(m.num_experts, 8)
        m.top_k = min(m.top_k, 2)
    m.aux_loss_type, m.aux_loss_coeff = "none", 0.0  # the peers compute no aux loss in the block
    return m


def foldmoe_layer(m: ModelConfig, kernels: list[str], device, dtype) -> MoELayer:
    cfg = ModelConfig(**{**m.__dict__, "moe_kernels": kernels, "shared_expert_ffn_hidden_size": 0})
    layer = MoELayer(cfg)
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.02)
        layer.experts.w13.normal_(0, 0.02)
        layer.experts.w2.normal_(0, 0.02)
    return layer.to(device, dtype)


def peer_block(name: str, m: ModelConfig, ours: MoELayer, implementation: str, device, dtype):
    """The transformers block for `name`, holding the same weights as `ours` (None when transformers is missing)."""
    try:
        if name.startswith("mixtral"):
            from transformers import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

            cfg = MixtralConfig(hidden_size=m.hidden_size, intermediate_size=m.moe_ffn_hidden_size,
                                num_local_experts=m.num_experts, num_experts_per_tok=m.top_k)
        else:
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

            cfg = Qwen3MoeConfig(hidden_size=m.hidden_size, moe_intermediate_size=m.moe_ffn_hidden_size,
                                 num_experts=m.num_experts, num_experts_per_tok=m.top_k, norm_topk_prob=True)
    except ImportError:
        return None
    cfg._experts_implementation = implementation
    block = Block(cfg)
    f = m.moe_ffn_hidden_size
    with torch.no_grad():  # ours: w13 [E, h, 2f] (gate | up), w2 [E, f, h]; theirs: [E, 2f, h] and [E, h, f]
        block.gate.weight.copy_(ours.router.weight.float())
        block.experts.gate_up_proj.copy_(ours.experts.w13.transpose(1, 2).float())
        block.experts.down_proj.copy_(ours.experts.w2.transpose(1, 2).float())
    assert block.experts.gate_up_proj.shape[1] == 2 * f
    return block.to(device, dtype)


def time_fwd_bwd(fn, module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int,
                 device) -> tuple[float, torch.Tensor]:
    """Median ms of forward + backward; returns it and the output of the last run. The weights' gradients are dropped
    before each run, as a training step's `zero_grad(set_to_none=True)` does: otherwise backward would add into the
    previous run's (an extra pass over every expert weight's gradient, 1.2 ms at the Qwen3 shape on an H100).

    On CUDA the runs are queued back to back and each is timed by a pair of events: device time with the host ahead,
    as in a training step (services/trainer/train.py never waits for the device between layers or steps). A sync
    before each run would add the time the host takes to launch the first kernels into an empty queue."""
    cuda = device.type == "cuda"
    marks, times = [], []
    for i in range(iters + 2):
        module.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn(xi)
        out.backward(grad)
        if cuda:
            end.record()
            marks.append((start, end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in marks]
    return statistics.median(times[2:]), out.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shapes", nargs="+", default=["qwen3_30b_a3b", "mixtral_8x7b"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kernels", nargs="*", default=None, metavar="KERNEL",
                    help="foldmoe's `model.moe_kernels` for its kernels row (default: the config default)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, for a run without a GPU")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="also print the ROWS kernels with the most device time in foldmoe's layer (torch.profiler)")
    add_record_argument(ap)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = 256 if args.cpu_smoke else args.tokens
    dense = measure_peak_tflops(device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = Table()
    table.line(f"device {name} | torch {torch.__version__} | {tokens} tokens | {dtype} | "
               f"dense GEMM {dense:.0f} TFLOP/s")
    header = (f"{'shape':<14} {'implementation':<36} {'ms':>8} {'TFLOP/s':>8} {'% dense':>8} {'vs hf grouped':>13} "
              f"{'max rel err':>11}")
    table.line(header)
    table.line("-" * len(header))
    for shape in args.shapes:
        m = shape_config(shape, args.cpu_smoke)
        torch.manual_seed(0)
        x = torch.randn(tokens, m.hidden_size, device=device, dtype=dtype)
        grad = torch.randn_like(x)
        flops = 18 * tokens * m.top_k * m.hidden_size * m.moe_ffn_hidden_size
        ours = foldmoe_layer(m, ModelConfig().moe_kernels if args.kernels is None else args.kernels, device, dtype)
        torch_ops = foldmoe_layer(m, [], device, dtype)
        torch_ops.load_state_dict(ours.state_dict())
        rows = [("foldmoe MoELayer (kernels)", ours, ours), ("foldmoe MoELayer (torch ops)", torch_ops, torch_ops)]
        for impl in ("grouped_mm", "eager"):
            block = peer_block(shape, m, ours, impl, device, dtype)
            if block is None:
                table.line(f"{shape:<14} transformers is not installed: peer rows skipped")
                break
            label = "per-expert loop" if impl == "eager" else impl
            rows.append((f"transformers block ({label})", lambda t, b=block: b(t[None])[0], block))
        results, reference = [], None
        for label, fn, module in rows:
            iters = args.iters if "loop" not in label else max(2, args.iters // 3)
            ms, out = time_fwd_bwd(fn, module, x, grad, iters, device)
            if reference is None:
                reference = out.float()
            err = float((out.float() - reference).norm() / reference.norm().clamp_min(1e-12))
            results.append((label, ms, err))
            del out
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.profile and device.type == "cuda":
            from bench_train_step import print_profile  # bench/ is this script's directory

            def fwd_bwd(layer=ours):
                layer.zero_grad(set_to_none=True)
                layer(x.detach().requires_grad_(True)).backward(grad)

            print_profile(f"{shape} foldmoe MoELayer (kernels), one forward+backward", fwd_bwd, args.profile)
        hf = next((ms for label, ms, _ in results if "grouped_mm" in label), None)
        for label, ms, err in results:
            rate = flops / ms / 1e9
            vs = f"{hf / ms:12.2f}x" if hf else f"{'-':>13}"
            table.line(f"{shape:<14} {label:<36} {ms:8.2f} {rate:8.1f} {100 * rate / dense:7.1f}% {vs} {err:11.1e}")
    table.record(args.record, f"MoE layer forward+backward vs the transformers blocks, {tokens} tokens")


if __name__ == "__main__":
    main()
