#!/usr/bin/env bash
# The session's second machine (2026-12-05), ~6 min: issue 15's structured W-B through kvserve's server after the
# llguidance 1.6 fix (vLLM's side was measured an hour before on this host kind, pair-A below), then the new
# decode tiles: checked against the reference, timed on W-A's and W-B's decode shapes, and W-L end to end.
# Run from the repository root after staging gpu-1, gpu-2 (gpu-3, .carry/extra carried):
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-h200/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
python3 -c "import llguidance; print('llguidance', llguidance.__version__)"
if [ "${SKIP_PAIR:-0}" != 1 ]; then  # SKIP_PAIR=1 after `gpu_session.sh pair` ran both servers in this session
timeout 220 python3 benchmarks/online_pair.py --no-vllm --out "$out/pair.json" --raw-dir "$out/pair-raw" \
  --deadline-s 210 > "$out/pair.log" 2>&1
grep -v "^ \|Writing" "$out/pair.log" | grep "kvserve\||\|PASS\|FAIL\|Error" | cut -c1-260 | tail -30
grep -B2 -A12 "Traceback" "$out/pair-raw/kvserve-serve.log" 2>/dev/null | tail -30
fi
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "decode_tiles and None" \
  > "$out/tiles-test.log" 2>&1; tail -3 "$out/tiles-test.log"
timeout 110 python3 benchmarks/attention_kernels.py --only "(14/2 x 64) decode 256" --block-size 128 \
  --backends triton --out "$out/tiles-short.json" > "$out/tiles-short.log" 2>&1; grep "decode" "$out/tiles-short.log"
timeout 140 python3 -m bench.throughput --preset wl --attention-backend auto --skip-tokenizer-init --repeat 3 \
  --out "$out/kvserve-wl.json" > "$out/kvserve-wl.log" 2>&1
grep -v "Loading\|Writing\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass" "$out/kvserve-wl.log" | tail -8
