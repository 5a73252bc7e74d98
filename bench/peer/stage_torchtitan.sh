#!/usr/bin/env bash
# Stage torchtitan 0.2.2 and the few pure-Python packages its Qwen3 MoE training path imports into .peer/, so that
# bench/bench_peer_torchtitan.py can run on a GPU machine without internet. Run here, in the repository root:
#
#     bash bench/peer/stage_torchtitan.sh          # writes .peer/*.whl and .peer/activate.sh (~7 MiB)
#
# and on the GPU machine, before the benchmark:
#
#     source .peer/activate.sh                     # installs the wheels into /tmp/peer-site, puts it on PYTHONPATH
#
# The GPU machine must already have (they are not staged): Python 3.12, torch (2.11 + CUDA; FSDP2, DTensor,
# torch._grouped_mm), triton (torchtitan's MoE kernels module imports it), numpy (tensorboard), tokenizers
# (torchtitan.components.tokenizer is imported by the model's train spec), and foldmoe's own dependencies (pyyaml for
# the config loader), which our benchmarks need anyway. Nothing else.
#
# What is staged, and why (found by trial imports of the path the benchmark uses, `python -X importtime`):
#   torchtitan          the model (models/qwen3), its parallelize function, ParallelDims, JobConfig, optimizers, loss
#   tyro, docstring-parser, typeguard, typing-extensions
#                       torchtitan.config imports tyro (ConfigManager parses the JobConfig); tyro imports
#                       docstring_parser and typing_extensions >= 4.13, and typeguard when it checks a union field
#   torchdata           torchtitan.components.dataloader (imported by the train spec) imports StatefulDataLoader
#   tensorboard, protobuf, absl-py
#                       the model module imports protocols.train_spec -> components.metrics, which imports
#                       torch.utils.tensorboard at the top; that needs tensorboard, protobuf and absl
# Not staged: `datasets` (torchtitan's HF dataset module imports it at the top, but it pulls pyarrow, pandas, ...,
# ~60 MiB; the benchmark feeds random token ids and puts an inert placeholder module in its place when `datasets` is
# not installed), tomli (Python >= 3.11 has tomllib), einops, pillow, fsspec (not on this path).
set -euo pipefail

cd "$(dirname "$0")/../.."
PEER=.peer
mkdir -p "$PEER"
rm -f "$PEER"/*.whl

# Pinned so the GPU run is reproducible; all are py3-none-any wheels (no platform match needed), fetched as the
# GPU machine's Python 3.12 would resolve them.
pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -d "$PEER" -q \
    torchtitan==0.2.2 \
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.0 typing-extensions==4.15.0 \
    torchdata==0.11.0 \
    tensorboard==2.21.0 absl-py==2.5.1
# protobuf: the pure-Python wheel (the binary one would tie .peer to one platform and ABI)
pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d "$PEER" -q protobuf==7.36.2

cat > "$PEER/activate.sh" <<'EOF'
# source .peer/activate.sh: install the staged wheels (no index, no dependency resolution) into /tmp/peer-site and put
# it first on PYTHONPATH. Idempotent; the packages stay out of the system Python and the project's .venv. All wheels
# are pure Python, so where pip is missing they are simply unpacked. PYTHON picks the interpreter (default python3).
_peer_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_peer_py="${PYTHON:-python3}"
PEER_SITE="${PEER_SITE:-/tmp/peer-site}"
if "$_peer_py" -m pip --version >/dev/null 2>&1; then
    "$_peer_py" -m pip install --no-deps --no-index --upgrade --target "$PEER_SITE" -q "$_peer_dir"/*.whl
else
    "$_peer_py" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
        "$PEER_SITE" "$_peer_dir"/*.whl
fi || { echo "peer: installing the wheels in $_peer_dir into $PEER_SITE failed" >&2; return 1; }
export PYTHONPATH="$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}"
"$_peer_py" -c "import torchtitan, importlib.metadata as m; \
print('peer: torchtitan', m.version('torchtitan'), 'from', torchtitan.__path__[0])"
unset _peer_dir _peer_py
EOF

ls -l "$PEER"
du -sh "$PEER"
