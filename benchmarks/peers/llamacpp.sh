#!/usr/bin/env bash
# llama.cpp serving the default model's GGUF itself, on loopback.
#
#   benchmarks/peers/llamacpp.sh install          # own venv under ~/.cache/tandem/peers/llamacpp
#   benchmarks/peers/llamacpp.sh serve [PORT]     # foreground; SIGINT/SIGTERM stops it
#
# Default: llama.cpp's own C++ `llama-server`, built from the llama.cpp sources vendored in
# the `llama-cpp-python` package (pip compiles that package, a few minutes, then CMake builds
# the server, about 9 more), batching requests continuously with --parallel
# (TANDEM_LLAMACPP_PARALLEL, default 16 slots): llama.cpp as its users serve it.
# TANDEM_LLAMACPP_IMPL=python runs the Python server of `llama-cpp-python[server]` instead,
# which serves one request at a time behind a lock (`--n_threads 2 --interrupt_requests
# False`: both cores, and a stream finishes when the next request arrives).
# Other env: TANDEM_LLAMACPP_THREADS (2), TANDEM_LLAMACPP_CTX (2048 per slot), TANDEM_LLAMACPP_PIP_SPEC,
# TANDEM_PEERS_DIR, TANDEM_PYTHON, TANDEM_GGUF.
# On an AMX Xeon (a VM, 2026-12) the C++ server died at its warm-up with SIGILL in the AMX
# weight buffer it repacks into; llama.cpp's own LLAMA_ARG_REPACK=false (--no-repack) serves
# on its AVX-512 kernels instead, and was how it was measured there.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VENV="$PEERS_DIR/llamacpp"
IMPL="${TANDEM_LLAMACPP_IMPL:-cpp}"
THREADS="${TANDEM_LLAMACPP_THREADS:-2}"
CTX="${TANDEM_LLAMACPP_CTX:-2048}"
PARALLEL="${TANDEM_LLAMACPP_PARALLEL:-16}"

install() {
  make_venv llamacpp >/dev/null
  local py="$VENV/bin/python"
  if ! "$py" -c 'import llama_cpp.server' 2>/dev/null; then
    log "pip install '${TANDEM_LLAMACPP_PIP_SPEC:-llama-cpp-python[server]}' (compiles, ~7 min on 2 cores)"
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
      "$py" -m pip install "${TANDEM_LLAMACPP_PIP_SPEC:-llama-cpp-python[server]}"
  fi
  [[ "$IMPL" == cpp ]] && build_cpp_server
  log "llama-cpp-python $("$py" -m pip show llama-cpp-python | awk '/^Version:/{print $2}') ready in $VENV"
}

build_cpp_server() {
  local bin="$VENV/llama.cpp/build/bin/llama-server"
  [[ -x "$bin" ]] && return
  local py="$VENV/bin/python" version src
  "$py" -m pip install -q cmake
  version="$("$py" -m pip show llama-cpp-python | awk '/^Version:/{print $2}')"
  src="$VENV/src"
  rm -rf "$src" && mkdir -p "$src"
  log "fetching the llama-cpp-python $version sdist for its vendored llama.cpp"
  "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$src"
  tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
  rm -rf "$VENV/llama.cpp" && mv "$src"/llama_cpp_python-*/vendor/llama.cpp "$VENV/llama.cpp"
  log "building llama-server (~9 min on 2 cores)"
  "$VENV/bin/cmake" -S "$VENV/llama.cpp" -B "$VENV/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF >&2
  "$VENV/bin/cmake" --build "$VENV/llama.cpp/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" >&2
}

serve() {
  local port="${1:-8100}" gguf
  [[ -x "$VENV/bin/python" ]] || install
  gguf="$(default_gguf)"
  log "llama.cpp ($IMPL) serving $gguf on 127.0.0.1:$port"
  if [[ "$IMPL" == cpp ]]; then
    [[ -x "$VENV/llama.cpp/build/bin/llama-server" ]] || build_cpp_server
    exec "$VENV/llama.cpp/build/bin/llama-server" -m "$gguf" --host 127.0.0.1 --port "$port" \
      -t "$THREADS" --parallel "$PARALLEL" -c "$((CTX * PARALLEL))" --cont-batching \
      --alias "$(basename "$gguf" .gguf)"
  fi
  exec "$VENV/bin/python" -m llama_cpp.server --model "$gguf" --host 127.0.0.1 --port "$port" \
    --n_threads "$THREADS" --n_ctx "$CTX" --interrupt_requests False \
    --model_alias "$(basename "$gguf" .gguf)"
}

case "${1:-}" in
  install) install ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 install | serve [PORT]" >&2; exit 2 ;;
esac
