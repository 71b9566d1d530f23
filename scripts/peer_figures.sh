#!/usr/bin/env bash
# The peer comparison figures in the README, sized for a 2-core CPU machine.
#   scripts/peer_figures.sh [vllm|llamacpp ...]     results in bench-results/, logs in results/
# A figure whose bench-results/NAME.json exists is skipped (FORCE=1 reruns it), so an
# interrupted run resumes where it stopped. The README's headline figures are recorded under
# benchmarks/results/<this CPU kind>/ (scripts/figures.py); `python scripts/figures.py render`
# then puts them in the README's table.
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
headline() {  # headline FIGURE RESULT ROW METRIC ARGS...: record one ratio of a finished run
  local figure="$1" file="bench-results/$2.json" row="$3" metric="$4"; shift 4
  [ -f "$file" ] && python scripts/figures.py from-compare "$figure" "$file" --row "$row" \
    --metric "$metric" --command "tandem bench compare $*" \
    --notes "scripts/peer_figures.sh; peer: $PEER (benchmarks/peers/$PEER.sh)"
}
PEERS=("$@"); [ ${#PEERS[@]} -eq 0 ] && PEERS=(vllm llamacpp)
for PEER in "${PEERS[@]}"; do
  COMMON="--peer $PEER --seed 0 --plot --disable-tqdm --save-result"
  R="--dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos"
  fig fig-random-c1-$PEER $COMMON $R --max-concurrency 1 --num-prompts 16
  fig fig-random-c16-c64-$PEER $COMMON $R --max-concurrency 16,64 --num-prompts 128
  headline "$PEER-c16" fig-random-c16-c64-$PEER 0 output_throughput $COMMON $R --max-concurrency 16,64 --num-prompts 128
  [ "$PEER" = llamacpp ] && headline llamacpp-c1-tpot fig-random-c1-$PEER 0 mean_tpot_ms \
    $COMMON $R --max-concurrency 1 --num-prompts 16
  fig fig-sharegpt-c16-$PEER $COMMON --dataset-name sharegpt --num-prompts 100 --max-concurrency 16
  fig fig-sweep-$PEER $COMMON $R --num-prompts 48 --request-rate 0.25,0.5,1 --goodput ttft:3000 tpot:250
done
