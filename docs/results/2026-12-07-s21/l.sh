#!/usr/bin/env bash
# Twenty-first session, call L (gpu-1..3 and vllm-1..3 staged; carrying .carry/vllm-4): issue 19's hybrid split of
# long steps (fresh prompts to flash-attn-4 without pages, short cached chunks and decodes to Triton).
# 1. its GPU tests against the reference; 2. one layer of W-L's step shapes, flash-attn-4 alone (one call, the old
#    hybrid) against the split hybrid; 3. W-L end to end beside vLLM 0.24.0 (gpu_session.sh vs-vllm-l).
#   bash .carry/vllm-4/stage.sh | tail -1 && bash docs/results/2026-12-07-s21/l.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
timeout -s KILL 200 python3 -u -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py \
  tests/test_attention_hybrid_split.py -k "hybrid or long_prefill or mixed_batch" > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
grep -q " failed\| error" "$out/tests.log" && { grep -E "^(FAILED|ERROR)" "$out/tests.log" | head; exit 1; }
timeout -s KILL 150 python3 benchmarks/attention_kernels.py --only "qwen2.5-0.5b (14/2 x 64) prefill" \
  --block-size 128 --backends flash-attn-4,triton+flash-attn-4 --no-variants --iters 30 --out "$out/attn.json" \
  > "$out/attn.log" 2>&1
grep -v "Deprec\|LayoutEnum\|OperandMajor\|from cutlass" "$out/attn.log" | tail -8 | cut -c1-200
OUT="$out" bash benchmarks/gpu_session.sh vs-vllm-l
