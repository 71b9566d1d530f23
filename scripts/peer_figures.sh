#!/usr/bin/env bash
# The peer comparison figures in the README, sized for a 2-core CPU machine.
#   scripts/peer_figures.sh [vllm|llamacpp ...]     results in bench-results/, logs in results/
# A figure whose bench-results/NAME.json exists is skipped (FORCE=1 reruns it), so an
# interrupted run resumes where it stopped.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TANDEM_VLLM_DTYPE="${TANDEM_VLLM_DTYPE:-float32}"  # bf16 is emulated on AVX2-only CPUs
mkdir -p results
fig() {  # fig NAME ARGS...
  local name="$1"; shift
  if [[ -z "${FORCE:-}" && -f "bench-results/$name.json" ]]; then echo "skip $name (done)"; return; fi
  tandem bench compare "$@" --result-filename "$name.json" 2>&1 | tee "results/$name.log"
}
PEERS=("$@"); [ ${#PEERS[@]} -eq 0 ] && PEERS=(vllm llamacpp)
for PEER in "${PEERS[@]}"; do
  COMMON="--peer $PEER --seed 0 --plot --disable-tqdm --save-result"
  R="--dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos"
  fig fig-random-c1-$PEER $COMMON $R --max-concurrency 1 --num-prompts 16
  fig fig-random-c16-c64-$PEER $COMMON $R --max-concurrency 16,64 --num-prompts 128
  fig fig-sharegpt-c16-$PEER $COMMON --dataset-name sharegpt --num-prompts 100 --max-concurrency 16
  fig fig-sweep-$PEER $COMMON $R --num-prompts 48 --request-rate 0.25,0.5,1 --goodput ttft:3000 tpot:250
done
