#!/usr/bin/env bash
# Seventeenth session, call A (gpu-1, gpu-2, vllm-1..4 staged; carrying .carry/gpu-3, .carry/extra, .carry/peers,
# .carry/vllm-extra, .carry/tok): the device's wait for grammar masks (engine/mask_gate.py), then issue 15's pair.
#   1. its GPU tests (KVSERVE_TEST_TOKENIZER: the tiny models' tokenizer, saved by benchmarks/save_test_tokenizer.py);
#   2. only if they pass: issue 15's pair beside vLLM's server as s15/c.sh runs it (W-B greedy json 0/20/100%).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && REPEAT=5 DEADLINE_S=300 bash docs/results/2026-12-07-s17/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out/tests"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/tests/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export KVSERVE_TEST_TOKENIZER="$PWD/.carry/tok"
timeout 280 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_mask_gate.py tests/test_grammar_link.py \
  tests/test_structured_masking.py > "$out/tests/tests.log" 2>&1
rc=$?
grep -v "Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir\|exe_args" "$out/tests/tests.log" | tail -40
if [ "$rc" != 0 ]; then echo "tests failed (rc $rc): no pair"; exit 1; fi
OUT="$out/pair" bash docs/results/2026-12-06-s15/c.sh
