# Shared by the peer recipes: where peers live, and the default model in the forms they load.
# Sourced, not run. Every step is idempotent: a second run finds what the first made.
set -euo pipefail

PEERS_DIR="${TANDEM_PEERS_DIR:-$HOME/.cache/tandem/peers}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The Python that runs tandem (has transformers, gguf, accelerate): it converts the model.
TANDEM_PYTHON="${TANDEM_PYTHON:-python3}"
# The Python that seeds each peer's own virtual environment.
PEER_BASE_PYTHON="${PEER_BASE_PYTHON:-python3}"

log() { echo "[peer] $*" >&2; }

# make_venv NAME -> path of a fresh-or-existing venv under $PEERS_DIR
make_venv() {
  local venv="$PEERS_DIR/$1"
  if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv"
    mkdir -p "$PEERS_DIR"
    "$PEER_BASE_PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
  fi
  echo "$venv"
}

# default_gguf -> the bundled default model's GGUF file (or $TANDEM_GGUF)
default_gguf() {
  if [[ -n "${TANDEM_GGUF:-}" ]]; then echo "$TANDEM_GGUF"; return; fi
  "$TANDEM_PYTHON" -c 'from tandem.model.loader import default_model_path; print(default_model_path())'
}

# default_hf_folder -> the default GGUF dequantized by transformers into an HF folder
default_hf_folder() {
  local gguf; gguf="$(default_gguf)"
  local out="$PEERS_DIR/models/$(basename "$gguf" .gguf)-hf"
  if [[ ! -f "$out/config.json" ]]; then
    log "converting $gguf -> $out (transformers, ~30 s)"
    "$TANDEM_PYTHON" "$HERE/gguf_to_hf.py" "$gguf" "$out" >&2
  fi
  echo "$out"
}
