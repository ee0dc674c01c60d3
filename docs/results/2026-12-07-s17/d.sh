#!/usr/bin/env bash
# Seventeenth session, call D (a fresh machine, nothing staged; carrying .carry/extra, .carry/tok): after the first
# H100 hung in the gate's tests (the Triton wait, flags in registered host memory), which wait works here
# (gate_probe.py), then the gate's GPU tests, output unbuffered, each test under a timeout.
#   bash docs/results/2026-12-07-s17/d.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 KVSERVE_TEST_TOKENIZER="$PWD/.carry/tok"
timeout 150 python3 docs/results/2026-12-07-s17/gate_probe.py 2>&1 | grep -v "Warning\|warn(" | tee "$out/probe.txt"
timeout 330 python3 -u -m pytest -v -x --timeout 150 -p no:cacheprovider -m gpu tests/test_mask_gate.py \
  tests/test_grammar_link.py 2>&1 | grep -v "Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir\|exe_args" \
  > "$out/tests.log"
grep -E "PASS|FAIL|ERROR|passed|failed|Timeout|Error" "$out/tests.log" | tail -30
