"""Probe: can the optimizer's update hide behind the next step's forward on one GPU?

The single-GPU step's AdamW pass runs at memory bandwidth after backward (bench/RESULTS.md, issue #7). Megatron
overlaps the distributed optimizer's parameter all-gather with the next forward; with one process the analogue is to
run the update on a side stream while the forward starts, each module waiting for its own parameters. Before building
that, this measures what two streams give at all: the update alone, the forward alone, both queued on one stream, and
both on two streams (the forward's stream at normal or high priority). Device time of each, queued behind a GPU sleep
(`bench_kernels.time_ms`), on the trainer's model and optimizer with real gradients. The two-stream runs read
parameters while they are written: timing only.

    python bench/probe_update_overlap.py --config configs/qwen3_30b_a3b.yaml model.num_layers=4 \
        data.micro_batch_size=2 optimizer.param_dtype=bf16 optimizer.moment_dtype=bf16 model.compile=true
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.bench_kernels as bench_kernels  # noqa: E402
from bench.bench_train_step import synthetic_batch  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.trainer.model.transformer import MoETransformer  # noqa: E402
from services.trainer.optim import build_adamw, clip_and_step  # noqa: E402
from services.trainer.step import forward_backward, to_device  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/qwen3_30b_a3b.yaml")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_update_overlap needs a CUDA device")
    cfg = load_config(args.config, args.overrides)
    device = torch.device("cuda")
    bench_kernels.HOST_SLACK_CYCLES = 400_000_000  # a whole forward's launches fit behind the sleep
    torch.manual_seed(0)
    with torch.device(device):
        model = MoETransformer(cfg.model)
    model.init_weights(0)
    opt = build_adamw(model, cfg.optimizer)
    batch = synthetic_batch(cfg.data.seq_len, cfg.data.micro_batch_size, cfg.model.vocab_size,
                            torch.Generator().manual_seed(0))
    tokens = cfg.data.seq_len * cfg.data.micro_batch_size

    def step():
        opt.zero_grad(set_to_none=True)
        forward_backward(model, [batch], tokens, device, torch.bfloat16)
        clip_and_step(opt, model.parameters(), cfg.optimizer.clip_grad)

    def forward():
        b = to_device(batch, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(b["tokens"], b["position_ids"], b["cu_seqlens"], b["max_seqlen"], labels=b["labels"])

    def time_ms(fn) -> float:
        return bench_kernels.time_ms(fn, 2, args.reps)

    for _ in range(4):  # compile and warm up
        step()
    rows = [("whole step (forward, backward, update)", time_ms(step))]
    opt.zero_grad(set_to_none=True)
    forward_backward(model, [batch], tokens, device, torch.bfloat16)  # gradients for the updates below
    rows += [("update alone", time_ms(opt.step)), ("forward alone", time_ms(forward)),
             ("update then forward, one stream", time_ms(lambda: (opt.step(), forward())))]
    for label, priority in (("normal", 0), ("high", -1)):
        side, main = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=priority)

        def both():
            here = torch.cuda.current_stream()
            side.wait_stream(here)
            main.wait_stream(here)
            with torch.cuda.stream(side):
                opt.step()
            with torch.cuda.stream(main):
                forward()
            here.wait_stream(side)
            here.wait_stream(main)
        rows.append((f"update || forward, two streams (forward's {label} priority)", time_ms(both)))
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {tokens} tokens | device ms, median of "
          f"{args.reps}")
    for name, ms in rows:
        print(f"  {name:<58}{ms:8.2f}")


if __name__ == "__main__":
    main()
