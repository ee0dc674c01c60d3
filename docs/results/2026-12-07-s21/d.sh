#!/usr/bin/env bash
# Twenty-first session, call D (gpu-1..3 and vllm-1..4 staged): issue 19's item 4, decode over long contexts beside
# vLLM 0.24.0 (W-L's 8k prompts, 1,024 output tokens each), then W-L's step profile with the split hybrid.
#   bash docs/results/2026-12-07-s21/d.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
REPEAT=2 OUT="$out" bash benchmarks/gpu_session.sh wl-decode
timeout -s KILL 200 python3 benchmarks/profile_workload.py --preset wl --attention-backend triton+flash-attn-4 \
  --windows 2-5,120-123 --out "$out/profile-wl.json" --plot "$out/steps.png" > "$out/profile-wl.log" 2>&1
grep -v "Deprec\|LayoutEnum\|OperandMajor\|from cutlass" "$out/profile-wl.log" | tail -30 | cut -c1-220
