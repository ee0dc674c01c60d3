#!/usr/bin/env bash
# Seventh session, call 2 (same machine, right after a.sh; carrying .carry/peers): issue 19's W-B, W-A, vLLM's
# W-A and W-B, W-L and vLLM's W-L, in one call (`gpu_session.sh vs-vllm`, ~5.5 min).
#   export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-05-s7/b.sh
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/gpu_session.sh vs-vllm
