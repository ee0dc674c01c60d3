#!/usr/bin/env bash
# Tenth session, call B (same machine, right after a.sh, which installed .carry/extra into /tmp/site; carrying
# .carry/peers): issue 19's W-B, W-A and W-L beside vLLM 0.24.0 (`gpu_session.sh vs-vllm`, ~5.5 min), then the
# grammar processes' profile through the server with 4 processes (~1.5 min: a Step's way, its answer, the
# mask kernel's apply time in the warm-up load).
#   export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s10/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 400 bash benchmarks/gpu_session.sh vs-vllm
PROCESSES=4 timeout 160 bash docs/results/2026-12-06-s8/a.sh
