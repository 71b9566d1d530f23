#!/usr/bin/env bash
# The peer comparison figures in the README, sized for a 2-core CPU machine.
#   scripts/peer_figures.sh [vllm|llamacpp ...]     results in bench-results/, logs in results/
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TANDEM_VLLM_DTYPE="${TANDEM_VLLM_DTYPE:-float32}"  # bf16 is emulated on AVX2-only CPUs
mkdir -p results
PEERS=("$@"); [ ${#PEERS[@]} -eq 0 ] && PEERS=(vllm llamacpp)
for PEER in "${PEERS[@]}"; do
  COMMON="--peer $PEER --seed 0 --plot --disable-tqdm --save-result"
  R="--dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos"
  tandem bench compare $COMMON $R --max-concurrency 1 --num-prompts 16 --result-filename fig-random-c1-$PEER 2>&1 | tee results/fig-random-c1-$PEER.log
  tandem bench compare $COMMON $R --max-concurrency 16,64 --num-prompts 128 --result-filename fig-random-c16-c64-$PEER 2>&1 | tee results/fig-random-c16-c64-$PEER.log
  tandem bench compare $COMMON --dataset-name sharegpt --num-prompts 100 --max-concurrency 16 --result-filename fig-sharegpt-c16-$PEER 2>&1 | tee results/fig-sharegpt-c16-$PEER.log
  tandem bench compare $COMMON $R --num-prompts 48 --request-rate 0.25,0.5,1 --goodput ttft:3000 tpot:250 --result-filename fig-sweep-$PEER 2>&1 | tee results/fig-sweep-$PEER.log
done
