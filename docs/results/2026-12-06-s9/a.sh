#!/usr/bin/env bash
# Ninth session, call A (after staging gpu-1, gpu-2, vllm-1..4; carrying .carry/gpu-3, .carry/extra, .carry/peers,
# .carry/vllm-extra): the mask kernel checked and timed (xgrammar's Triton kernel, side-stream copy), then issue
# 15's W-B at json 0/20/100% through kvserve's server and vLLM 0.24.0's, 3 repetitions (~8 min).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s9/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_structured_masking.py > "$out/masking-tests.log" 2>&1
tail -2 "$out/masking-tests.log"
timeout 90 python3 benchmarks/mask_apply.py --out "$out/mask_apply.json" 2>&1 | tee "$out/mask_apply.log" | tail -5
if [ -d .carry/extra/vllm ]; then
  mkdir -p .carry/vllm-extra && cp .carry/extra/vllm/*.whl .carry/vllm-extra/
fi
PAIR_DEADLINE_S="${PAIR_DEADLINE_S:-420}" timeout $((${PAIR_DEADLINE_S:-420} + 20)) \
  bash benchmarks/gpu_session.sh pair --repeat "${REPEAT:-3}"  # REPEAT, PAIR_DEADLINE_S: what s10/a.sh sets
