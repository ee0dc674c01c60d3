#!/usr/bin/env bash
# For the next GPU (gpu-1..3 staged; carrying .carry/extra): the twenty-second session's decode rule (ranges of
# 2048 keys over 128-token pages) checked, then A/B on W-L in one process: the hybrid as shipped, its Triton
# decode given ranges of 1024 (the old rule) and 2048 (the new), alternated, one engine each (~5 min). Read the
# decode step group's seconds per run, and the decode windows' attention us per step.
#   bash docs/results/2026-12-07-s22/d.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py \
  -k test_triton_decode_tiles_match_reference > "$out/tiles-test.log" 2>&1  # every tile and page size, 2048 included
tail -3 "$out/tiles-test.log"
grep -q " passed" "$out/tiles-test.log" && ! grep -q " failed" "$out/tiles-test.log" || exit 1
timeout 400 python3 benchmarks/profile_workload.py --preset wl --attention-backend triton+flash-attn-4 \
  --triton-decode-split-keys 1024,2048,1024,2048 --windows 120-123 --out "$out/wl-ab.json" > "$out/wl-ab.log" 2>&1
tail -30 "$out/wl-ab.log" | cut -c1-200
