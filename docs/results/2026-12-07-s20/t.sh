#!/usr/bin/env bash
# Twentieth session, call T (a fresh machine, nothing staged; carrying .carry/server, .carry/extra, .carry/tok): the
# gate's GPU tests first (MaskGate now loads its copy kernel before any wait; the killed-process test says what
# each constrained request ended with), then every other GPU test in what is left of LIMIT_S (flash-attn-4 is not
# staged: its cases skip).
#   LIMIT_S=430 bash docs/results/2026-12-07-s20/t.sh
set -u
out="${OUT:-./gpu-out}"; start=$(date +%s); mkdir -p "$out"
left() { echo $(( ${LIMIT_S:-430} - 8 - $(date +%s) + start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/server/*.whl .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 KVSERVE_TEST_TOKENIZER="$PWD/.carry/tok"
clean() { grep -v "Deprecat\|Warning\|warn("; }
timeout -s KILL 150 python3 -u -m pytest -v -p no:cacheprovider -m gpu tests/test_mask_gate.py \
  tests/test_grammar_link.py tests/test_structured_masking.py 2>&1 | clean > "$out/gate.log"; echo "gate rc $?"
grep -E "PASS|FAIL|ERROR|passed|failed|assert|^E " "$out/gate.log" | tail -30
timeout -s KILL "$(left)" python3 -u -m pytest -p no:cacheprovider -m gpu -x -q tests/test_gpu_parity.py \
  tests/test_warm_up_gpu.py tests/test_kernels.py tests/test_attention_gpu.py 2>&1 | clean > "$out/rest.log"
echo "rest rc $?"; grep -E "FAIL|ERROR|passed|failed|^E " "$out/rest.log" | tail -20
