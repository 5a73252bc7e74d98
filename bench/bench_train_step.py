"""Single-GPU training-step throughput of the foldmoe trainer core (model + step + AdamW), on synthetic packed batches.

    python bench/bench_train_step.py --config configs/qwen3_30b_a3b.yaml model.num_layers=2 data.seq_len=4096 \
        data.micro_batch_size=2 run.steps=20

Prints tokens/s, MFU against the datasheet peak and against a GEMM peak measured in the same run, peak memory, the
tokens/s of the held-out evaluation's forward (services/trainer/evaluate.py) on the same model, and the memory of one
step by category (parameters, gradients, optimizer state, activations, other: memory_report.py).
The data path (dataloader service) is excluded on purpose: this isolates compute. `--record bench/RESULTS.md` appends the
final tables there with machine, command and commit.

Side by side: each `--variant "NAME key=value ..."` runs the same steps on the same initial weights with those config
overrides on top of the base config, one after the other in this process (weights are initialised once), and a table
compares them at the end. For example, the MoE data path on torch ops vs the Triton kernels, and recompute:

    --variant "torch model.moe_kernels=[]" --variant "kernels" --variant "kernels+router model.moe_kernels=[permutation,activation,router]" \
    --variant "kernels+moe_act model.recompute=[moe_act]" --variant "kernels+moe model.recompute=[moe]"

FP8: `--variant "bf16" --variant "fp8_tensorwise model.fp8=tensorwise"` puts the routed experts (Triton kernel) and the
dense linears (Transformer Engine, which must then be installed) in FP8; the variant's model is built on the GPU, so it
runs the same paths as training.
"""

from __future__ import annotations

import argparse
import copy
import gc
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import Table, add_record_argument  # noqa: E402
from services.common.config import Config, load_config  # noqa: E402
from services.trainer.memory_report import MemoryReport, measure_step  # noqa: E402
from services.trainer.metrics import (StepValues, active_params, datasheet_peak, flops_per_token,  # noqa: E402
                                      measure_peak_tflops)
from services.trainer.evaluate import evaluate  # noqa: E402
from services.trainer.model.recompute import apply_memory_policy  # noqa: E402
from services.trainer.model.transformer import MoETransformer  # noqa: E402
from services.trainer.optim import build_adamw, clip_and_step  # noqa: E402
from services.trainer.parallel.groups import single_process  # noqa: E402
from services.trainer.step import forward_backward  # noqa: E402


def synthetic_batch(seq_len: int, mbs: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """mbs sequences, each packed with documents of random lengths (mean ~seq_len/4)."""
    lengths = []
    for _ in range(mbs):
        left = seq_len
        while left > 0:
            n = min(left, int(torch.randint(64, seq_len // 2, (1,), generator=gen)))
            lengths.append(n)
            left -= n
    T = seq_len * mbs
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    tokens = torch.randint(0, vocab, (T,), generator=gen)
    return {"tokens": tokens, "labels": torch.roll(tokens, -1), "position_ids": pos, "cu_seqlens": cu,
            "max_seqlen": max(lengths)}


@dataclass
class Outcome:
    name: str
    tokens_per_s: float
    mfu: float
    peak_gib: float
    step_ms: float
    final_loss: float
    memory: MemoryReport
    eval_tokens_per_s: float  # the held-out evaluation's forward (services/trainer/evaluate.py)


def run_variant(name: str, cfg: Config, weights: dict[str, torch.Tensor], batches, device, sheet: float,
                profile_rows: int = 0, trace: str | None = None) -> Outcome:
    """Build the model for `cfg` on the device from `weights`, apply its memory policy, time `run.steps` steps; with
    `profile_rows`, two more steps run under torch.profiler and the kernels with the most device time are printed."""
    with torch.device(device):  # parameters allocated on the device, buffers (RoPE frequencies) computed there
        model = MoETransformer(cfg.model)
    model.load_state_dict(weights)
    apply_memory_policy(model, cfg.model.recompute, cfg.model.offload, cfg.model.recompute_layers,
                        cfg.model.offload_layers)
    opt = build_adamw(model, cfg.optimizer)
    tokens = cfg.data.seq_len * cfg.data.micro_batch_size * cfg.data.grad_accum
    torch.cuda.reset_peak_memory_stats()
    times: list[float] = []

    def train_step(mbs):
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(model, mbs, tokens, device, torch.bfloat16)
        clip_and_step(opt, model.parameters(), cfg.optimizer.clip_grad)
        return loss

    # As the trainer does (services/trainer/train.py): step k's loss is read on the host (StepValues) only after step
    # k+1 has been queued, so the device never waits for the host between steps. A step's time is the time between
    # two such reads: its device time once the host runs ahead.
    torch.cuda.synchronize()
    last, queued = time.perf_counter(), None
    for step in range(cfg.run.steps + 1):
        values = StepValues(loss=train_step(batches[step % len(batches)])) if step < cfg.run.steps else None
        if queued is not None:
            value = float(queued.read()["loss"]) / tokens
            now = time.perf_counter()
            times.append(now - last)
            last = now
            print(f"[{name}] step {step} loss {value:.4f} {tokens / times[-1]:,.0f} tok/s", flush=True)
        queued = values
    steady = statistics.median(times[3:]) if len(times) > 5 else statistics.median(times)
    tps = tokens / steady
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    memory = measure_step(model, opt, lambda: train_step(batches[0]), device)  # one more step, counted by category
    eval_tps = evaluation_rate(model, cfg, batches, device)
    if profile_rows:
        print_profile(name, lambda: train_step(batches[0]), profile_rows, trace and f"{trace}.{name}.json")
    outcome = Outcome(name, tps, 100 * tps * fpt / 1e12 / sheet, peak_gib, steady * 1000, value, memory, eval_tps)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return outcome


def evaluation_rate(model: MoETransformer, cfg: Config, batches, device, reps: int = 4) -> float:
    """Tokens/s of the trainer's held-out evaluation (`evaluate`: eval mode, no autograd) over a step's micro-batches,
    after two untimed calls (a compiled model compiles its no-grad versions). Each call reads its loss on the host, so
    the time between calls is the device's."""
    cfg = copy.deepcopy(cfg)
    cfg.data.eval_micro_batches = len(batches[0])

    def run(i: int) -> None:
        evaluate(model, batches[i % len(batches)], single_process(), cfg, device, torch.bfloat16)

    run(0), run(1)
    start = time.perf_counter()
    for i in range(reps):
        run(i)
    return reps * cfg.data.seq_len * cfg.data.micro_batch_size * len(batches[0]) / (time.perf_counter() - start)


# Memory-bound operators the profile lists by input shape: where casts, adds and fills come from.
GLUE_OPS = {"aten::copy_", "aten::add_", "aten::add", "aten::mul", "aten::mul_", "aten::fill_", "aten::sum",
            "aten::zero_", "aten::cat", "aten::index_select", "aten::embedding_dense_backward"}


def print_profile(name: str, step, rows: int, trace: str | None = None) -> None:
    """Device time per kernel over two steps, as a share of the steps' device time: where the step goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time_total)
    total = sum(sum(v) for v in kernels.values())
    print(f"\nprofile of 2 steps, {name}: kernel time {total / 2e3:.1f} ms per step; top kernels by device time")
    print(f"{'kernel':<90}{'ms/step':>9}{'share':>8}{'calls':>7}")
    for kname, ts in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"{kname[:89]:<90}{sum(ts) / 2e3:>9.2f}{100 * sum(ts) / total:>7.1f}%{len(ts) // 2:>7}")
    print(f"\nprofile of 2 steps, {name}: operators by their own kernels' device time")
    ops = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    print(f"{'operator':<60}{'ms/step':>9}{'calls':>7}")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"{e.key[:59]:<60}{e.self_device_time_total / 2e3:>9.2f}{e.count // 2:>7}")
    print(f"\nprofile of 2 steps, {name}: memory-bound operators by input shapes (where casts and adds come from)")
    glue = [e for e in prof.key_averages(group_by_input_shape=True)
            if e.self_device_time_total > 0 and e.key in GLUE_OPS]
    print(f"{'operator':<16}{'ms/step':>9}{'calls':>7}  input shapes")
    for e in sorted(glue, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"{e.key:<16}{e.self_device_time_total / 2e3:>9.2f}{e.count // 2:>7}  {str(e.input_shapes)[:120]}")



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help='"NAME key=value ...": config overrides on top of the base config; repeatable')
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="print the ROWS kernels with the most device time per variant (torch.profiler, 2 steps)")
    ap.add_argument("--trace", default=None, metavar="PREFIX",
                    help="with --profile, also write the profiled steps as a Chrome trace, PREFIX.<variant>.json")
    ap.add_argument("overrides", nargs="*")
    add_record_argument(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_step needs a CUDA device")
    variants = [shlex.split(v) for v in args.variant] or [["base"]]
    configs = [(words[0], load_config(args.config, [*args.overrides, *words[1:]])) for words in variants]
    base = load_config(args.config, args.overrides)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = MoETransformer(base.model)
    model.init_weights(0)
    weights = model.state_dict()  # on the host: a device copy would not fit next to a variant's model and Adam state
    del model
    gen = torch.Generator().manual_seed(0)
    batches = [[synthetic_batch(base.data.seq_len, base.data.micro_batch_size, base.model.vocab_size, gen)
                for _ in range(base.data.grad_accum)] for _ in range(4)]
    sheet = datasheet_peak(device)
    outcomes = []
    for name, cfg in configs:
        outcomes.append(run_variant(name, cfg, weights, batches, device, sheet, args.profile, args.trace))
        m = cfg.model
        o = outcomes[-1]
        print(f"RESULT {name} | moe_kernels {m.moe_kernels} recompute {m.recompute} offload {m.offload} | "
              f"tokens/s {o.tokens_per_s:,.0f} | MFU {o.mfu:.1f}% of {sheet:.0f} | peak mem {o.peak_gib:.1f} GiB | "
              f"median step {o.step_ms:.0f} ms | final loss {o.final_loss:.4f} | evaluation tokens/s "
              f"{o.eval_tokens_per_s:,.0f}", flush=True)
        print(f"memory of one step, {name}:\n{o.memory.table()}", flush=True)
    measured = measure_peak_tflops(device, torch.bfloat16)
    fpt = flops_per_token(base.model, base.data.seq_len)
    table = Table()
    table.line(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | active params "
               f"{active_params(base.model) / 1e9:.3f}B | GEMM peak measured {measured:.0f} TFLOP/s")
    table.line(f"{'variant':<24}{'tokens/s':>12}{'MFU sheet':>11}{'MFU meas.':>11}{'peak GiB':>10}{'step ms':>9}"
               f"{'eval tok/s':>12}")
    for o in outcomes:
        table.line(f"{o.name:<24}{o.tokens_per_s:>12,.0f}{o.mfu:>10.1f}%"
                   f"{100 * o.tokens_per_s * fpt / 1e12 / measured:>10.1f}%{o.peak_gib:>10.1f}{o.step_ms:>9.0f}"
                   f"{o.eval_tokens_per_s:>12,.0f}")
    table.line("\nmemory by category, GiB (services/trainer/memory_report.py; one step after the timed ones)")
    names = [r[0] for r in outcomes[0].memory.rows()]
    table.line(f"{'variant':<16}" + "".join(f"{n.split(' (')[0][:16]:>17}" for n in names))
    for o in outcomes:
        table.line(f"{o.name:<16}" + "".join(f"{v / 2**30:>17.2f}" for _, v in o.memory.rows()))
    table.record(args.record, "Training step, one GPU" + (f", {args.config}" if args.config else "")
                 + (f" {' '.join(args.overrides)}" if args.overrides else ""))


if __name__ == "__main__":
    main()
