"""Host memory and time of Hugging Face export and import (`python -m services.checkpointer.convert export|import`),
this tree against another (`--baseline`, e.g. a worktree of an earlier commit).

    python bench/bench_hf_convert.py --config configs/qwen3_30b_a3b.yaml --dir /tmp/hfc model.num_layers=2
                                     [--baseline /tmp/old-tree] [--family qwen3_moe] [--record bench/RESULTS.md]

Writes a checkpoint of the config's model (random weights) under --dir once, then for each tree runs `export` of it
(bf16) and `import` of that export, each in a process of its own, and prints the peak anonymous resident memory of
that process (RssAnon, sampled every 5 ms by this one: the files read are memory-mapped, and their page-cache pages,
which the kernel can drop, are left out), its time, and the export's files.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_model_load import write_checkpoint_once  # noqa: E402
from bench.record import Table, add_record_argument  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def peak_anon(command: list[str], cwd: Path) -> tuple[float, float, str]:
    """(peak RssAnon GiB, seconds, the last line of stderr) of `command` run to its end; raises on failure."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            for line in open(f"/proc/{proc.pid}/status"):
                if line.startswith("RssAnon:"):
                    peak = max(peak, int(line.split()[1]))
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.005)
    err = proc.communicate()[1]
    seconds = time.perf_counter() - start
    last = err.strip().splitlines()[-1] if err.strip() else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} in {cwd}: exit {proc.returncode}: {last}")
    return peak / 2**20, seconds, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--dir", type=Path, required=True, help="where the checkpoint is written (once) and converted")
    ap.add_argument("--baseline", type=Path, default=None, help="another tree to run the same commands in")
    ap.add_argument("--family", default="qwen3_moe")
    add_record_argument(ap)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args()
    ckpt = args.dir / "ckpt"
    write_checkpoint_once(args.config, args.overrides, ckpt)
    trees = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    table = Table()
    table.line(f"checkpoint {ckpt}: {' '.join(args.overrides)}; export --family {args.family} --dtype bfloat16")
    table.line(f"{'tree':<9} {'command':<7} {'peak anon GiB':>14} {'seconds':>8}  output")
    for name, tree in trees:
        hf, back = args.dir / f"hf-{name}", args.dir / f"back-{name}"
        for out in (hf, back):
            shutil.rmtree(out, ignore_errors=True)
        convert = [sys.executable, "-m", "services.checkpointer.convert"]
        for command, argv in (("export", ["export", str(ckpt), str(hf), "--family", args.family]),
                              ("import", ["import", str(hf), str(back)])):
            gib, seconds, _ = peak_anon(convert + argv, tree)
            written = sorted(p for p in (hf if command == "export" else back).rglob("*") if p.is_file())
            size = sum(p.stat().st_size for p in written) / 2**30
            table.line(f"{name:<9} {command:<7} {gib:>14.2f} {seconds:>8.1f}  {len(written)} files, {size:.2f} GiB")
        for out in (hf, back):
            shutil.rmtree(out, ignore_errors=True)
    if args.record:
        table.record(args.record, "Hugging Face export and import: host memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
