"""RL rollout costs in one process: generation throughput of one rollout engine, and trainer -> worker weight sync.

    python bench/bench_rollout.py [--config configs/rl_tiny.yaml] [--prompts 256] [--max-new-tokens N] [--syncs 3] \
        [--prompt-len N] [--system-len N] [--keep-stops] [--threads N] [--json PATH] [section.key=value ...]
    python bench/bench_rollout.py --config configs/qwen3_30b_a3b.yaml model.num_layers=2 --prompts 64

1. Generation: the policy (MoETransformer + init_weights; CUDA bf16 when CUDA is available and run.device is not cpu,
   else CPU fp32) in an `Engine` built as the worker builds it (rl.max_batch slots of rl.max_seq_len), generating
   `--prompts` prompts of the configured task (rl.task, rl.difficulty; `--prompt-len`: each lengthened by a random
   prefix of its own; `--system-len`: then all behind one random system prompt of that many tokens) x rl.group_size
   samples with the configured temperature / top-p / top-k. Stop strings and EOS
   are ignored unless --keep-stops, so every completion is exactly `--max-new-tokens` long and runs compare like with
   like. The same requests are generated once untimed first (on
   CUDA that captures every decode shape as a CUDA graph, `rl.cuda_graphs`; its wall time is printed), then timed as
   they run (tokens/s). A third pass splits the time: prefill and decode (the KV-cache forwards, each waited for
   before and after) are timed by wrapping the engine's `CachedDecoder`; the rest is sampling and bookkeeping. Those
   waits take away the overlap of the host's bookkeeping with the queued steps, so that pass is slower.
2. Weight sync: the trainer's `WeightPublisher` (from rl: weight_dtype, weight_chunk_mb) on 127.0.0.1 and the worker's
   `PolicyWeights` over a `WeightReceiver` into a second model instance, in this process. Each of `--syncs` rounds
   publishes a new version of the policy's state_dict (host copy in the sync dtype) and pulls it (`refresh()`: all
   the shared file or the chunks + load_state_dict); the pulled weights are checked bit-equal (in the sync dtype) to the published.
   The publisher's first `keep + 1` versions page-lock new host buffers (prepared in the background, as the RL trainer
   does, so the first publish waits for them), later ones reuse them: publish and pull are reported apart for those
   first rounds and for the rest (the median of each); give --syncs > 3 for the latter.
   Publisher and worker share this host, so the worker reads the publisher's shared-memory files where /dev/shm has
   room for them (the transport is printed; on CUDA it registers each file with CUDA once, on its first read, as a
   worker does); `FOLDMOE_SHM_DIR=/nonexistent` measures the chunks over ZMQ instead.
   The second model is zeroed before each pull (untimed) so the check cannot pass by accident. Note: the published
   model is the rollout model (bf16 on CUDA), while the trainer publishes its fp32 master weights.

Memory: two model instances on the device, plus up to four host copies in the sync dtype (the publisher keeps 2
versions and the buffers of a third, page-locked; the receiver reassembles one).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.config import load_config  # noqa: E402
from services.common.tokenizer import load_tokenizer  # noqa: E402
from services.rl_rollout.engine import Engine, Request  # noqa: E402
from services.rl_rollout.rewards import get_task  # noqa: E402
from services.rl_rollout.sampling import SamplingParams  # noqa: E402
from services.rl_rollout.weights import PolicyWeights, WeightReceiver  # noqa: E402
from services.trainer.model.transformer import MoETransformer  # noqa: E402
from services.trainer.rl.weight_publisher import WeightPublisher  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, acc: list[float]):
    """`fn` wrapped so that its synchronised wall time is added to acc[0]."""
    def wrapper(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(device)
        acc[0] += time.perf_counter() - t0
        return out
    return wrapper


def bench_generation(cfg, model, device, args) -> dict:
    rl = cfg.rl
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    task, rng = get_task(rl.task), random.Random(cfg.run.seed)
    params = SamplingParams(temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k, max_tokens=args.max_new_tokens,
                            stop=tuple(rl.stop) if args.keep_stops else (), stop_at_eos=args.keep_stops)
    prompts = [tokenizer.encode(task.make_prompt(rng, rl.difficulty)[0]) for _ in range(args.prompts)]
    # Longer prompts: each one's own random prefix of byte ids (valid in every vocabulary here) before the task's text
    prompts = [[rng.randrange(256) for _ in range(args.prompt_len - len(p))] + p for p in prompts]
    system = [rng.randrange(256) for _ in range(args.system_len)]  # one for all prompts
    prompts = [system + p for p in prompts]
    requests = [Request(p, params, tag=(g, i)) for g, p in enumerate(prompts) for i in range(rl.group_size)]
    engine = Engine(model, tokenizer, rl.max_batch, rl.max_seq_len, seed=cfg.run.seed, cuda_graphs=rl.cuda_graphs,
                    prefill_tokens=rl.prefill_tokens)
    sync(device)
    t0 = time.perf_counter()
    engine.generate(requests)  # warm-up: every shape the timed pass meets (CUDA graph captures, Triton autotuning)
    sync(device)
    first = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    prefilled, shared = engine.prompt_tokens_prefilled, engine.prompt_tokens_shared
    completions = engine.generate(requests)  # timed as it runs: host bookkeeping overlaps the queued steps
    sync(device)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    prefilled, shared = engine.prompt_tokens_prefilled - prefilled, engine.prompt_tokens_shared - shared
    # Where the time goes, from a third pass whose forwards each wait for the device before and after (which takes
    # the overlap away: its wall time is printed apart)
    prefill, decode = [0.0], [0.0]
    engine.cache.prefill = timed(engine.cache.prefill, device, prefill)
    engine.cache.decode = timed(engine.cache.decode, device, decode)
    sync(device)
    t0 = time.perf_counter()
    engine.generate(requests)
    sync(device)
    split_wall = time.perf_counter() - t0
    cache_bytes = engine.cache.cache_bytes
    engine.close()
    tokens = sum(len(c.tokens) for c in completions)
    return {"gen_requests": len(requests), "gen_prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
            "gen_tokens": tokens, "gen_wall_s": wall, "gen_tokens_per_s": tokens / wall,
            "gen_prompts_per_s": len(prompts) / wall, "gen_completion_len_mean": tokens / len(requests),
            "gen_prefill_s": prefill[0], "gen_decode_s": decode[0], "gen_kv_cache_bytes": cache_bytes, "gen_other_s": split_wall - prefill[0] - decode[0],
            "gen_split_wall_s": split_wall, "gen_peak_above_start_bytes": peak, "gen_prompt_tokens_prefilled": prefilled, "gen_prompt_tokens_shared": shared,
            "gen_first_pass_s": first, "cuda_graphs": engine.cache.cuda_graphs, "stops_honoured": args.keep_stops}


def bench_sync(cfg, model, device, dtype, syncs: int) -> dict:
    publisher = WeightPublisher.from_config(cfg.rl, host="127.0.0.1").start()
    with torch.device(device):
        target = MoETransformer(cfg.model)
    target.to(dtype=dtype).eval()
    publisher.prepare({k: publisher.spec(v) for k, v in model.state_dict().items()})  # as the RL trainer does
    receiver = WeightReceiver(publisher.endpoint, timeout_s=600.0, pin=device.type == "cuda")  # as PolicyWeights' own
    policy = PolicyWeights(target, receiver, cfg.rl.max_staleness)
    state = model.state_dict()
    wire_dtype = publisher.dtype
    nbytes = sum(t.numel() * (wire_dtype.itemsize if t.is_floating_point() else t.element_size())
                 for t in state.values())
    n_params = sum(p.numel() for p in model.parameters())
    pubs, pulls = [], []
    try:
        for version in range(1, syncs + 1):
            with torch.no_grad():
                for t in target.state_dict().values():
                    if t.is_floating_point():
                        t.zero_()
            sync(device)
            t0 = time.perf_counter()
            publisher.publish(version, state)
            t1 = time.perf_counter()
            assert policy.refresh(timeout_s=600.0) and policy.version == version, "weights were not pulled"
            sync(device)
            t2 = time.perf_counter()
            pubs.append(t1 - t0)
            pulls.append(t2 - t1)
            pulled = target.state_dict()
            assert pulled.keys() == state.keys()
            for k, v in state.items():
                want = v.to("cpu", wire_dtype) if v.is_floating_point() else v.cpu()
                assert torch.equal(pulled[k].to("cpu", want.dtype), want), f"pulled {k} differs from the published"
            print(f"sync {version}: publish {t1 - t0:.3f}s pull {t2 - t1:.3f}s (weights verified)", flush=True)
    finally:
        policy.close()
        publisher.stop()
    transport = "shared memory" if policy.receiver.shared_reads else "ZMQ chunks"
    fresh = publisher.keep + 1  # rounds that page-locked new buffers
    steady = pubs[fresh:] or pubs
    totals = [p + q for p, q in zip(steady, pulls[fresh:] or pulls)]
    total = statistics.median(totals)
    return {"sync_publish_first_s": statistics.median(pubs[:fresh]), "sync_steady_rounds": len(pubs[fresh:]),
            "sync_dtype": str(wire_dtype).removeprefix("torch."), "sync_bytes": nbytes, "sync_params": n_params,
            "sync_chunk_mb": cfg.rl.weight_chunk_mb, "sync_rounds": syncs, "sync_transport": transport,
            "sync_publish_s": statistics.median(steady), "sync_pull_s": statistics.median(pulls[fresh:] or pulls),
            "sync_pull_first_s": statistics.median(pulls[:fresh]), "sync_total_s": total,
            "sync_s_per_billion_params": total / (n_params / 1e9), "sync_gb_per_s": nbytes / 1e9 / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/rl_tiny.yaml")
    ap.add_argument("--prompts", type=int, default=256, help="prompts to generate (each x rl.group_size samples)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="completion length (default rl.max_new_tokens)")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="lengthen each prompt to this many tokens with a random prefix of its own (0: the task's)")
    ap.add_argument("--system-len", type=int, default=0,
                    help="put one random system prompt of this many tokens before every prompt (0: none)")
    ap.add_argument("--keep-stops", action="store_true", help="honour rl.stop and EOS (lengths then vary)")
    ap.add_argument("--syncs", type=int, default=6,
                    help="publish+pull rounds; the median is reported (0: no weight sync section)")
    ap.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default); on a busy CPU "
                    "machine 1 avoids OpenMP oversubscription, which can slow small models by 50x")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    args.max_new_tokens = args.max_new_tokens or cfg.rl.max_new_tokens
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and cfg.run.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(cfg.run.seed)
    t0 = time.perf_counter()
    model = MoETransformer(cfg.model)
    model.init_weights(cfg.run.seed)
    model = model.to(device=device, dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:,.1f}M params on {device} {str(dtype).removeprefix('torch.')} "
          f"(built in {time.perf_counter() - t0:.1f}s)", flush=True)
    result = {"config": args.config, "overrides": args.overrides,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).removeprefix("torch."),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "params": n_params,
              "prompts": args.prompts, "group_size": cfg.rl.group_size, "max_new_tokens": args.max_new_tokens,
              "max_batch": cfg.rl.max_batch, "max_seq_len": cfg.rl.max_seq_len, "task": cfg.rl.task,
              "temperature": cfg.rl.temperature, "top_p": cfg.rl.top_p, "top_k": cfg.rl.top_k}
    result |= bench_generation(cfg, model, device, args)
    if args.syncs:
        result |= bench_sync(cfg, model, device, dtype, args.syncs)
    r = result
    rows = [
        ("setup", f"{r['device']} {r['dtype']}, {n_params / 1e6:,.1f}M params, torch {r['torch']}, "
                  f"{r['threads']} CPU threads"),
        ("requests", f"{args.prompts} prompts x {r['group_size']} = {r['gen_requests']}, max_batch {r['max_batch']}, "
                     f"prompt {r['gen_prompt_tokens_mean']:.1f} tok, stops {'on' if args.keep_stops else 'off'}"),
        ("generated tokens/s", f"{r['gen_tokens_per_s']:,.1f} ({r['gen_tokens']:,} tokens in {r['gen_wall_s']:.2f}s)"),
        ("prompts/s", f"{r['gen_prompts_per_s']:,.2f} ({r['gen_requests'] / r['gen_wall_s']:,.1f} samples/s)"),
        ("prompt tokens", f"{r['gen_prompt_tokens_prefilled']:,} prefilled, {r['gen_prompt_tokens_shared']:,} copied "
                          "from a slot holding the same prompt or prefix"),
        ("mean completion len", f"{r['gen_completion_len_mean']:.2f} tokens (max {args.max_new_tokens})"),
        ("KV cache", f"{r['gen_kv_cache_bytes'] / 2**20:,.1f} MiB ({r['max_batch']} slots of "
                     f"{r['max_seq_len']} tokens)"),
        ("peak memory", f"{r['gen_peak_above_start_bytes'] / 2**20:,.1f} MiB above the timed pass's start (CUDA; "
                        f"activations and temporaries: the cache and weights are already held)"),
        ("prefill / decode / other", f"{r['gen_prefill_s']:.2f}s / {r['gen_decode_s']:.2f}s / {r['gen_other_s']:.2f}s "
                                     f"(a pass with a wait around each forward: {r['gen_split_wall_s']:.2f}s)"),
        ("decode", f"{'CUDA graphs' if r['cuda_graphs'] else 'eager'}; the untimed first pass of the same requests "
                   f"took {r['gen_first_pass_s']:.2f}s"),
    ]
    rows += [
        ("weight sync", f"{r['sync_bytes'] / 1e6:,.1f} MB in {r['sync_dtype']}, pulled from {r['sync_transport']} "
                        f"(chunks {r['sync_chunk_mb']:g} MiB), median of {args.syncs}"),
        ("publish + pull", f"{r['sync_publish_s']:.3f}s + {r['sync_pull_s']:.3f}s = {r['sync_total_s']:.3f}s "
                           f"(over {r['sync_steady_rounds'] or args.syncs} rounds through reused buffers; the first "
                           f"rounds, through new ones: {r['sync_publish_first_s']:.3f}s + {r['sync_pull_first_s']:.3f}s)"),
        ("s per B params", f"{r['sync_s_per_billion_params']:.3f}"),
        ("GB/s", f"{r['sync_gb_per_s']:.3f}"),
    ] if args.syncs else []
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
