#!/usr/bin/env bash
# Twenty-third session (gpu-1..3 staged; carrying .carry/extra): the decode tiles' GPU test (ranges of 2048
# included) and the fused gate/up + SiLU*mul kernel's GPU test and benchmark (checked before timed), then W-L
# in one process, a 2x2 of Triton decode ranges (1024, 2048) and the MLP fused from 4,096 rows or never,
# one engine each, the kernel's tile the benchmark's fastest (~9 min).
#   bash docs/results/2026-12-07-s23/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py tests/test_mlp_kernel.py \
  -k "test_triton_decode_tiles_match_reference or mlp" > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
timeout 90 python3 benchmarks/gate_up_silu.py --out "$out/gate_up_silu.json" > "$out/gate_up_silu.log" 2>&1
cat "$out/gate_up_silu.log" | cut -c1-180
tile=(); [ -s "$out/gate_up_silu.json" ] && tile=(--fused-mlp-tile-json "$out/gate_up_silu.json")
timeout 330 python3 benchmarks/profile_workload.py --preset wl --attention-backend triton+flash-attn-4 \
  --triton-decode-split-keys 1024,2048 --fused-mlp-min-tokens 1000000000000000,4096 "${tile[@]}" \
  --windows 2-3,120-121 --out "$out/wl-2x2.json" > "$out/wl-2x2.log" 2>&1
grep -E "^== |group|decode 33|prefill" "$out/wl-2x2.log" | cut -c1-160
