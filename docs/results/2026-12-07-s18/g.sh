#!/usr/bin/env bash
# Eighteenth session, call G (a fresh machine, nothing staged; carrying .carry/extra, .carry/tok): the gate's hang.
# The copy behind the wait is now checked at engine start (a watchdog raises the flags, so the check cannot hang),
# and a kernel copy (`mask_gate._copy`) stands beside cudaMemcpyAsync; which host calls block while the device waits
# (sync_probe.py). Every step is killed hard at its bound.
#   bash docs/results/2026-12-07-s18/g.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 KVSERVE_TEST_TOKENIZER="$PWD/.carry/tok"
clean() { grep -v "Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir\|exe_args\|Warning\|warn("; }
[ -n "${SKIP_PROBE:-}" ] || timeout -s KILL 60 python3 docs/results/2026-12-07-s17/gate_probe.py \
  driver64-registered-copy triton-registered-copy 2>&1 | clean | tee "$out/probe.txt"
timeout -s KILL 100 python3 docs/results/2026-12-07-s18/sync_probe.py 2>&1 | clean | tee "$out/sync_probe.txt"
timeout -s KILL 100 python3 -u -m pytest -v -p no:cacheprovider -m gpu tests/test_mask_gate.py 2>&1 | clean \
  > "$out/gate.log"; echo "gate rc $?"
grep -E "PASS|FAIL|ERROR|passed|failed|assert|Error" "$out/gate.log" | tail -20
timeout -s KILL "${LINK_S:-240}" python3 -u -m pytest -v -p no:cacheprovider -m gpu tests/test_grammar_link.py \
  -o log_cli=true --log-cli-level=INFO 2>&1 | clean > "$out/link.log"; echo "link rc $?"
grep -E "PASS|FAIL|ERROR|passed|failed|grammar masks" "$out/link.log" | sort | uniq -c | sort -rn | head -30
