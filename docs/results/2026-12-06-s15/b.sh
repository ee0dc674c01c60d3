#!/usr/bin/env bash
# Fifteenth session, call B (no staging needed beyond what s13/a.sh asks; carrying .carry/extra): the Triton
# attention kernels' GPU tests after the tiles came to share online_softmax (attention/triton_split.py), then the
# thirteenth session's TMA-against-pointer decode timing (s13/a.sh: ~3.5 min), on the H200 where the decode
# reads K/V faster than on the H100.
#   bash docs/results/2026-12-06-s15/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "triton and not tma" > "$out/attention-tests.log" 2>&1
tail -1 "$out/attention-tests.log"; grep -E "^(FAILED|ERROR)" "$out/attention-tests.log" | head
OUT="$out" bash docs/results/2026-12-06-s13/a.sh
