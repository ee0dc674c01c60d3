#!/usr/bin/env bash
# For the next H200 (gpu-1..3 and vllm-1..4 staged; carrying .carry/extra): issue 19's W-L beside vLLM 0.24.0, then
# its item 4, W-L decode (1,024 output tokens) beside vLLM (~8 min).
#   bash docs/results/2026-12-07-s21/w.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
OUT="$out" bash benchmarks/gpu_session.sh vs-vllm-l
REPEAT=2 OUT="$out" bash benchmarks/gpu_session.sh wl-decode
