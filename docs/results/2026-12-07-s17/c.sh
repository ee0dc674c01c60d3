#!/usr/bin/env bash
# Seventeenth session, call C (gpu-1, gpu-2 staged; carrying .carry/gpu-3, .carry/extra, .carry/tok), for a machine
# without vLLM staged (an H100 first): the gate's GPU tests, then only if they pass b.sh (kvserve alone, the host
# waiting against the device waiting).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && REPEAT=3 bash docs/results/2026-12-07-s17/c.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out/tests"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/tests/gpu.txt"
lscpu | grep -E "^(CPU\\(s\\)|Model name)" > "$out/tests/lscpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export KVSERVE_TEST_TOKENIZER="$PWD/.carry/tok"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_mask_gate.py tests/test_grammar_link.py \
  tests/test_structured_masking.py > "$out/tests/tests.log" 2>&1
rc=$?
grep -v "Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir\|exe_args" "$out/tests/tests.log" | tail -30
if [ "$rc" != 0 ]; then echo "tests failed (rc $rc)"; exit 1; fi
OUT="$out/ab" bash docs/results/2026-12-07-s17/b.sh
