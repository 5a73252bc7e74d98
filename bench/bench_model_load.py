"""Host memory of loading a checkpoint for inference (`foldmoe generate` / `evaluate`): streamed into a model built in
place, against the whole state read first and then loaded into a model built on the host.

    python bench/bench_model_load.py --config configs/qwen3_30b_a3b.yaml --dir /tmp/load model.num_layers=1
                                     [--hf FAMILY] [--record bench/RESULTS.md]

Writes a checkpoint of the config's model (random weights) under --dir once, then loads it (or, with --hf FAMILY, an
HF export of it, made once in bf16) in a fresh process each way and prints that process's peak anonymous resident memory (RssAnon, sampled every 5 ms: the checkpoint's files
are memory-mapped, and their pages, which the kernel can drop, would count in the resident total) and time:
`streamed` is services/rl_rollout/generate.py `load_model` (run.device and run.dtype decide where the model goes, in
what dtype); `whole` reads every tensor into a dict (an HF directory: `import_hf`), builds the model on the host in
fp32, loads the dict and moves the model there, as load_model did before.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import Table, add_record_argument  # noqa: E402

PROBE = """
import json, sys, threading, time
import torch
from pathlib import Path
from services.common.config import load_config
peak = [0]
def sample():  # anonymous memory only: the checkpoint's files are mapped, and their pages are the page cache's
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak[0] = max(peak[0], int(line.split()[1]))
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
cfg = load_config(sys.argv[2], json.loads(sys.argv[3]))
ckpt = Path(sys.argv[4])
if sys.argv[1] == "streamed":
    from services.rl_rollout.generate import load_model
    model = load_model(ckpt, cfg, None).model
else:
    from services.checkpointer.convert import find_checkpoint, iter_model_state, trained_config
    from services.checkpointer.hf import import_hf
    from services.rl_rollout.worker import rollout_model_config
    from services.trainer.model.transformer import MoETransformer
    if (ckpt / "config.json").is_file():  # an HF directory: imported whole, as load_model did before
        state, model_cfg = import_hf(ckpt)
    else:
        step = find_checkpoint(ckpt)
        model_cfg = trained_config(step)
        state = dict(iter_model_state(step, model_cfg))
    from services.rl_rollout.worker import rollout_device
    model = MoETransformer(rollout_model_config(model_cfg))
    model.load_state_dict(state)
    del state
    device = rollout_device(cfg)
    bf16 = device.type == "cuda" and cfg.run.dtype == "bf16"
    model.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
params = sum(p.numel() for p in model.parameters())
time.sleep(0.05)
print(json.dumps({"seconds": time.perf_counter() - t0, "anon_gib": peak[0] / 2**20,
                  "params": params, "device": str(next(model.parameters()).device),
                  "dtype": str(next(model.parameters()).dtype)}))
"""


def write_checkpoint_once(config: str | None, overrides: list[str], root: Path) -> None:
    """A checkpoint of the config's model with random weights under `root`, unless one is there."""
    if (root / "latest").exists():
        return
    from services.checkpointer.convert import write_checkpoint
    from services.common.config import load_config
    from services.trainer.model.transformer import MoETransformer

    cfg = load_config(config, overrides).model
    state = MoETransformer(cfg).state_dict()
    write_checkpoint(root, state.items(), {k: tuple(t.shape) for k, t in state.items()}, cfg, "bench",
                     "a benchmark's random weights", "")
    params = sum(t.numel() for t in state.values())
    print(f"wrote {root} ({cfg.num_layers} layers, {params:,} parameters)", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--dir", type=Path, required=True, help="where the checkpoint is written (once) and read")
    ap.add_argument("--hf", metavar="FAMILY", default=None,
                    help="load an HF export of the checkpoint (made once, bf16, by `convert export`) instead")
    add_record_argument(ap)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args()
    root = args.dir / "ckpt"
    write_checkpoint_once(args.config, args.overrides, root)
    if args.hf:
        hf = args.dir / f"hf-{args.hf}"
        if not (hf / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "services.checkpointer.convert", "export", str(root), str(hf),
                            "--family", args.hf, "--force"], check=True, cwd=Path(__file__).resolve().parent.parent)
        root = hf
    table = Table()
    table.line(f"{'HF export' if args.hf else 'checkpoint'} {root}: {' '.join(args.overrides)}")
    table.line(f"{'way':<10} {'device':<8} {'dtype':<16} {'params':>14} {'peak anon GiB':>14} {'seconds':>8}")
    for way in ("whole", "streamed"):
        out = subprocess.run([sys.executable, "-c", PROBE, way, args.config or "", json.dumps(args.overrides),
                              str(root)], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if out.returncode != 0:
            why = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
            table.line(f"{way:<10} failed: {why}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        table.line(f"{way:<10} {r['device']:<8} {r['dtype']:<16} {r['params']:>14,} {r['anon_gib']:>14.2f} "
                   f"{r['seconds']:>8.1f}")
    if args.record:
        table.record(args.record, "Loading a checkpoint for inference: streamed into place vs whole")
    return 0


if __name__ == "__main__":
    sys.exit(main())
