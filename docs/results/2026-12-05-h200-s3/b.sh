#!/usr/bin/env bash
# Third session of 2026-12-05, second machine: issue 15's structured W-B through kvserve's server with xgrammar's
# masks (engine/grammar_xgr.py; vLLM's server was measured by `gpu_session.sh pair` on the first machine, an hour
# before), then issue 19's W-B and W-A through kvserve beside vLLM 0.24.0's offline engine in the same call.
# From the repository root, after staging gpu-1, gpu-2, vllm-1..4 (gpu-3, .carry/extra, .carry/peers carried):
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-h200-s3/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
python3 -c "import xgrammar, llguidance; print('xgrammar ok, llguidance', llguidance.__version__)"
timeout 200 python3 benchmarks/online_pair.py --no-vllm --out "$out/pair.json" --raw-dir "$out/pair-raw" \
  --deadline-s 190 > "$out/pair.log" 2>&1
grep -v "^ \|Writing" "$out/pair.log" | grep "kvserve\||\|PASS\|FAIL\|Error" | cut -c1-260 | tail -24
grep -B2 -A12 "Traceback" "$out/pair-raw/kvserve-serve.log" 2>/dev/null | tail -20
common=(--max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3)
show() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass" "$1" | tail -"$2"; }
kv() { timeout "$1" python3 -m bench.throughput --preset "$2" "${@:3}" --out "$out/kvserve-$2.json" \
         > "$out/kvserve-$2.log" 2>&1; show "$out/kvserve-$2.log" 3; }
kv 80 wb "${common[@]}"
kv 90 wa "${common[@]}"
PYTHONPATH=/tmp/vllm-site timeout 170 python3 .carry/peers/vllm_bench.py --reps 3 > "$out/vllm-ab.log" 2>&1
grep RESULT "$out/vllm-ab.log" | cut -c1-220
