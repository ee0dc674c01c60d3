#!/usr/bin/env bash
# Fifteenth session, call D (no staging; carrying .carry/extra), for the last ~5 min of the budget, on whichever
# card comes: on an H200, s13/a.sh (the TMA decode kernel against the pointer kernel: its tests, one layer's
# call, W-L end to end); on an H100 (where s13/a.sh ran already), the Triton attention kernels' GPU tests after
# their tiles came to share online_softmax.
#   bash docs/results/2026-12-06-s15/d.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt")
echo "$gpu"
if [[ "$gpu" == *H200* ]]; then
  OUT="$out" bash docs/results/2026-12-06-s13/a.sh
else
  pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
  export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "triton" > "$out/attention-tests.log" 2>&1
  tail -1 "$out/attention-tests.log"; grep -E "^(FAILED|ERROR)" "$out/attention-tests.log" | head
fi
