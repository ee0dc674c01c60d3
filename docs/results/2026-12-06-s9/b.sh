#!/usr/bin/env bash
# Ninth session, call B (same machine, right after a.sh; carrying .carry/peers): issue 19's W-B, W-A and W-L
# beside vLLM 0.24.0 (`gpu_session.sh vs-vllm`, ~5.5 min), then the decode tile variants checked and timed
# (`gpu_session.sh tiles`, ~2 min).
#   export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s9/b.sh
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/gpu_session.sh vs-vllm
timeout 150 bash benchmarks/gpu_session.sh tiles
