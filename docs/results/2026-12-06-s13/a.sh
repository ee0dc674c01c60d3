#!/usr/bin/env bash
# Thirteenth session, call A (no staging; carrying .carry/extra for msgspec, pyzmq and the like): the TMA decode
# kernel (attention/triton_decode_tma.py) checked against the reference, then timed against the pointer
# kernel on one layer's call (benchmarks/attention_kernels.py, W-L's and W-A's decode shapes at head dim 64,
# 128-token pages), then W-L end to end with each (triton backend, 128-token pages).
#   bash docs/results/2026-12-06-s13/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "tma" > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
timeout 230 python3 benchmarks/attention_kernels.py --only "x 64) decode" --skip-workloads "~600,8 x,~32k" --block-size 128 --backends triton \
  --out "$out/kernels.json" > "$out/kernels.log" 2>&1
grep "^|" "$out/kernels.log" | grep -v "^| shape\|^|---" | tail -120 | sort -t'|' -k3,3 -s | cut -c1-150
timeout 180 python3 benchmarks/profile_workload.py --preset wl --attention-backend triton --block-size 128 --windows "" \
  --triton-decode-kernel pointer,tma --out "$out/wl.json" > "$out/wl.log" 2>&1
grep -v "Loading weights\|Writing model\|capturing" "$out/wl.log" | tail -40
