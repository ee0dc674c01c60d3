#!/usr/bin/env bash
# Sixth session of 2026-12-05, call 2: issue 15's structured W-B at 0/20/100% through kvserve's server (the
# grammar process on: the default with CUDA) and vLLM 0.24.0's (`gpu_session.sh pair`), and the TTFT loads.
# After staging gpu-1, gpu-2, vllm-1..4 (and a.sh), carrying .carry/gpu-3, .carry/extra, .carry/peers:
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-s6/b.sh
set -u
if [ -d .carry/extra/vllm ]; then
  mkdir -p .carry/vllm-extra && cp .carry/extra/vllm/*.whl .carry/vllm-extra/
fi
bash benchmarks/gpu_session.sh pair --deadline-s 420
