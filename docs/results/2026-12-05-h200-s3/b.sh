#!/usr/bin/env bash
# Third session of 2026-12-05, second machine: issue 15's structured W-B through both servers again, kvserve now
# with xgrammar's masks (engine/grammar_xgr.py), in one run (`gpu_session.sh pair`). vLLM's structured-output
# wheels come from .carry/extra/vllm (a copy of .carry/vllm-extra: this call carries gpu-3, extra and peers).
# From the repository root, after staging gpu-1, gpu-2, vllm-1..4:
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-h200-s3/b.sh
set -u
if [ -d .carry/extra/vllm ]; then
  mkdir -p .carry/vllm-extra && cp .carry/extra/vllm/*.whl .carry/vllm-extra/
fi
bash benchmarks/gpu_session.sh pair --deadline-s 420
