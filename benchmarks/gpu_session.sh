#!/usr/bin/env bash
# One H200 session: GPU tests, then kvserve on the two standard workloads (W-A, W-B) with each GPU
# backend, then transformers on W-B, all logged under $OUT (or ./gpu-out). vLLM runs separately
# (shared/peers/vllm) on the same host right before or after; docs/benchmarks.md has the figures.
# Usage: bash benchmarks/gpu_session.sh [tests|bench|hf|all] [extra bench-throughput args...]
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
what="${1:-all}"; shift || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
common=(--max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3)
if [[ "$what" == tests || "$what" == all ]]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_attention_gpu.py \
    tests/test_gpu_parity.py 2>&1 | tail -25 | tee "$out/gpu-tests.log"
fi
if [[ "$what" == bench || "$what" == all ]]; then
  for preset in wb wa; do
    timeout 400 python3 -m server.bench_throughput --preset "$preset" --attention-backend "${BACKENDS:-flash-attn-4,triton}" \
      "${common[@]}" "$@" --out "$out/kvserve-$preset.json" 2>&1 | grep -v "Loading weights" | tail -30 \
      | tee "$out/kvserve-$preset.log"
  done
fi
if [[ "$what" == hf || "$what" == all ]]; then
  timeout 300 python3 -m server.bench_throughput --preset wb --attention-backend "${BACKENDS:-flash-attn-4}" \
    --compare-hf generate,generate_batch --max-model-len 2048 --max-num-batched-tokens 16384 --skip-tokenizer-init \
    --repeat 1 --out "$out/hf-wb.json" 2>&1 | grep -v "Loading weights" | tail -20 | tee "$out/hf-wb.log"
fi
