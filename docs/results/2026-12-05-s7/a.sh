#!/usr/bin/env bash
# Seventh session of 2026-12-05, call 1 (after staging gpu-1, gpu-2, vllm-1..4; carrying .carry/gpu-3,
# .carry/extra, .carry/peers): the grammar link's CUDA test, then issue 15's structured W-B at 0/20/100% through
# kvserve's server (grammar process on, the default with CUDA) and vLLM 0.24.0's (~8 min).
#   bash .carry/gpu-3/stage.sh && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-05-s7/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_grammar_link.py -k cuda > "$out/link-cuda.log" 2>&1
tail -2 "$out/link-cuda.log"
# The pair (s6/b.sh's, with arguments passed on to online_pair.py, e.g. --repeat 1 when the budget is short).
if [ -d .carry/extra/vllm ]; then
  mkdir -p .carry/vllm-extra && cp .carry/extra/vllm/*.whl .carry/vllm-extra/
fi
timeout 450 bash benchmarks/gpu_session.sh pair --deadline-s 420 "$@"
