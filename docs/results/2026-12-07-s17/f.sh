#!/usr/bin/env bash
# Seventeenth session, call F (a fresh machine, nothing staged; carrying .carry/extra, .carry/tok), d.sh trimmed to
# the budget left (~330 s): which wait works here (gate_probe.py), then the gate's kernel-level test and the engine
# test (gated outputs equal the host-waiting in-process run: free, xgrammar, llguidance, n=2 sampled, logprobs).
#   bash docs/results/2026-12-07-s17/f.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 KVSERVE_TEST_TOKENIZER="$PWD/.carry/tok"
timeout 100 python3 docs/results/2026-12-07-s17/gate_probe.py 2>&1 | grep -v "Warning\|warn(" | tee "$out/probe.txt"
timeout 150 python3 -u -m pytest -v -x --timeout 100 -p no:cacheprovider -m gpu tests/test_mask_gate.py \
  tests/test_grammar_link.py -k "copy_waits or on_cuda_the_link" 2>&1 \
  | grep -v "Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir\|exe_args" > "$out/tests.log"
grep -E "PASS|FAIL|ERROR|passed|failed|Timeout|Error|assert" "$out/tests.log" | tail -25
