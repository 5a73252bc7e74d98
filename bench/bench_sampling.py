"""The rollout's sampler over a decode step's logits: `kernels.sample` against the torch path it replaced.

    python bench/bench_sampling.py [--vocab 151936] [--batch 64 256] [--programs 1024] [--temperature 1.0]
                                   [--top-k 0] [--top-p 1.0] [--reps 20] [--record bench/RESULTS.md]

Rows per batch size: a device copy of the logits (the floor: the kernel must read them once); the torch path (fp32
cast, temperature divide, log_softmax, softmax, `torch.multinomial`, the greedy argmax, where and gather: what
services/rl_rollout/sampling.py ran for untruncated sampling before the kernel); `sample_categorical` with each
`--programs` target (kernels.sample.PROGRAMS: how finely rows are split, `splits_for`). bf16 logits drawn at random,
every row at `--temperature` (default 1: every row sampled; 0: every row greedy). Device milliseconds per call
(`bench_kernels.time_ms`: each call queued behind a GPU sleep, median of `reps`).
With `--top-k` or `--top-p` every row truncates: the torch path is then the sort that sampling.py ran for truncated
rows before kernels/truncation.py (sort, two softmaxes, a cumulative sum, `torch.multinomial`, log_softmax), and the
kernel column `truncation_floor` + `sample_categorical` (the floor search alone in its own column).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_kernels import time_ms  # noqa: E402
from bench.record import Table, add_record_argument  # noqa: E402
import kernels.sample as sample_module  # noqa: E402
from kernels.sample import sample_categorical, splits_for  # noqa: E402
import kernels.truncation as truncation_module  # noqa: E402
from kernels.truncation import truncation_floor  # noqa: E402


def torch_sampler(logits: torch.Tensor, temp: torch.Tensor, generator: torch.Generator):
    """Untruncated sampling as sampling.py did it with torch ops."""
    logits = logits.float()
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    drawn = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def torch_truncated_sampler(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            generator: torch.Generator):
    """Top-k / top-p sampling as sampling.py did it with torch ops, by a sort of each row."""
    logits = logits.float()
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (top_p[:, None] < 1) & ((probs.cumsum(-1) - probs) >= top_p[:, None])
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drawn = order.gather(1, torch.multinomial(probs, 1, generator=generator)).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--programs", type=int, nargs="+", default=[sample_module.PROGRAMS])
    ap.add_argument("--temperature", type=float, default=1.0, help="every row's temperature (0: greedy)")
    ap.add_argument("--top-k", type=int, default=0, help="every row's top-k (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every row's top-p (1: off)")
    ap.add_argument("--candidates", type=int, default=truncation_module.CANDIDATES,
                    help="keys the floor search tries a pass (kernels.truncation.CANDIDATES, a power of 2)")
    ap.add_argument("--reps", type=int, default=20)
    add_record_argument(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampling times GPU kernels and needs a CUDA GPU")
    dev = torch.device("cuda")
    generator = torch.Generator(dev).manual_seed(0)
    table = Table()
    truncating = args.top_k > 0 or args.top_p < 1
    truncation_module.CANDIDATES = args.candidates
    table.line(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | V={args.vocab} bf16 logits | temperature "
               f"{args.temperature:g} | top-k {args.top_k} | top-p {args.top_p:g} | {args.candidates} candidates a pass | "
               f"device ms, median of {args.reps}")
    table.line(f"{'batch':>6}  {'copy (floor)':>12}  {'torch path':>10}  {'programs':>8}  {'splits':>6}  "
               f"{'kernel':>8}  {'speedup':>7}  kernel GB/s" + ("  (floor search)" if truncating else ""))
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, device=dev).to(torch.bfloat16)
        temp = torch.full((batch,), args.temperature, device=dev)
        seed = torch.zeros(1, dtype=torch.int64, device=dev)
        top_k = torch.full((batch,), args.top_k, device=dev)
        top_p = torch.full((batch,), args.top_p, device=dev)
        uses = args.top_k > 0, args.top_p < 1
        copy = torch.empty_like(logits)
        t_copy = time_ms(lambda: copy.copy_(logits), 3, args.reps)
        if truncating:
            t_torch = time_ms(lambda: torch_truncated_sampler(logits, temp, top_k, top_p, generator), 3, args.reps)
            t_floor = time_ms(lambda: truncation_floor(logits, temp, top_k, top_p, *uses), 3, args.reps)
        else:
            t_torch = time_ms(lambda: torch_sampler(logits, temp, generator), 3, args.reps)

        def kernel():
            floor = truncation_floor(logits, temp, top_k, top_p, *uses) if truncating else None
            return sample_categorical(logits, temp, seed, floor)

        for programs in args.programs:
            sample_module.PROGRAMS = programs
            t_kernel = time_ms(kernel, 3, args.reps)
            gbs = logits.numel() * logits.element_size() / t_kernel / 1e6
            splits = splits_for(batch, args.vocab)[0]
            table.line(f"{batch:>6}  {t_copy:>12.3f}  {t_torch:>10.3f}  {programs:>8}  {splits:>6}  {t_kernel:>8.3f}"
                       f"  {t_torch / t_kernel:>6.1f}x  {gbs:,.0f}" + (f"  {t_floor:.3f}" if truncating else ""))
    table.record(args.record, "The rollout's sampler: kernels.sample against the torch path")


if __name__ == "__main__":
    main()
