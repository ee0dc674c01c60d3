#!/usr/bin/env bash
# Fourth session of 2026-12-05: the pipelined constrained step (engine/engine.py _step_behind_masks) on the
# device: xgrammar's bitmask kernel against its reference, the offline engine's json 0%/100% per-step
# sections (benchmarks/structured_step.py), then issue 15's server pair. From the repository root, after
# staging gpu-1, gpu-2, vllm-1..4, carrying .carry/gpu-3, .carry/extra, .carry/peers:
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-h100-s4/c.sh
set -u
if [ -d .carry/extra/vllm ]; then
  mkdir -p .carry/vllm-extra && cp .carry/extra/vllm/*.whl .carry/vllm-extra/
fi
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
out=${OUT:-/tmp/out}
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k xgrammar 2>&1 | tail -3
timeout 110 python3 benchmarks/structured_step.py --runs 2 --out "$out/structured_step.json" 2>&1 \
  | grep -v "Loading\|Writing\|capturing" | tail -24
bash benchmarks/gpu_session.sh pair --deadline-s 400
