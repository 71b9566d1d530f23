#!/usr/bin/env bash
# The CUDA checks, in one run on a machine with a CUDA GPU (from the repo root): the engine's
# tests that hold it to HF transformers, peft and its own float path, on the GPU (a LLM's
# device `auto` is CUDA there; HF's reference runs on the CPU), then the offline throughput
# against HF generate() and the quantized layers by rows. Results under $OUT (default
# bench-results/cuda). The C++ kernels are CPU-only and not built (TANDEM_NO_CPP_KERNELS).
# Deselected: tests of the default GGUF model (not on such a machine unless installed) and
# of the CPU's C++ kernels.
#
#     bash benchmarks/cuda_check.sh
OUT=${OUT:-bench-results/cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TANDEM_NO_CPP_KERNELS=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
$PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/env.txt"
$PY -m pytest -p no:cacheprovider -q -rfE tests/engine/test_hf_parity.py \
    tests/engine/test_llm_api.py tests/engine/test_prefix_caching.py \
    tests/engine/test_spec_decode.py tests/lora/test_lora_engine.py tests/model/test_kv_quant.py \
    tests/model/test_quantized_weights.py -k "(not test_quantized_weights or every_device or \
tiny_checkpoints or unpacks) and not default_model and not perplexity and not decode_kernel \
and not (mixing and kernel)" 2>&1 | tee "$OUT/tests.log" | tail -5
$PY benchmarks/cuda_throughput.py --layers --rows 1,4,8,16,32,64,128,256,512,2048 2>&1 | tee "$OUT/layers.log"
$PY benchmarks/cuda_throughput.py --json "$OUT/llama1b.json" 2>&1 | grep -v "Writing\|Loading" | tee "$OUT/llama1b.log" | tail -8
$PY benchmarks/cuda_throughput.py --shape smollm2-135m --quantization none,int4 --json "$OUT/smollm.json" 2>&1 | grep -v "Writing\|Loading" | tee "$OUT/smollm.log" | tail -6
