#!/usr/bin/env bash
# Twenty-first session, call G (an H100 with nothing staged; carrying .carry/server, .carry/extra, .carry/tok):
# Owed 4, the grammar link's tests (the whole file) and the gate's on a 16-core GPU host after the twentieth
# session's compile changes. Its log is g/grammar.log (6 failed, 42 passed; docs/benchmarks.md says why).
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
pip install --target /tmp/site --no-deps -q .carry/server/*.whl .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 KVSERVE_TEST_TOKENIZER="$PWD/.carry/tok"
timeout -s KILL 300 python3 -u -m pytest -q -p no:cacheprovider --durations=8 tests/test_grammar_link.py \
  tests/test_mask_gate.py 2>&1 | grep -v "Deprecat\|Warning\|warn(" > "$out/grammar.log"
tail -25 "$out/grammar.log"
