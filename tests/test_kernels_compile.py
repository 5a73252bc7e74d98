"""Every kernel compiles for Hopper (sm_90) with Triton's bundled compiler, GPU or not: the interpreter the other
kernel tests use on CPU accepts some programs the compiler rejects. Runs in a subprocess, because this process may
have built triton for the interpreter."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--arch", "90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 17 MoE-path variants (the row scatter also for capacity layouts) + 9 FP8 GEMM (tensorwise with split and fast accumulation, blockwise) / quantiser /
    # transpose ones + 2 AdamW (fp32 master / remainders) + 4 QK-norm + RoPE + 4 split-vocabulary cross-entropy
    assert proc.stdout.count(": ok") == 36, proc.stdout
