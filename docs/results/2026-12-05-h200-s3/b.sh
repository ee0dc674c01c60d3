#!/usr/bin/env bash
# Third session of 2026-12-05, second call after `gpu_session.sh pair`: issue 19's GPU tests for the new decode
# tiles, then W-B and W-A through kvserve beside vLLM 0.24.0's offline engine in the same call (~5 min).
# From the repository root, after staging gpu-1, gpu-2, vllm-1..4 (gpu-3, .carry/extra, .carry/peers carried):
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-h200-s3/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "decode_tiles or decode_ranges" \
  > "$out/tiles-test.log" 2>&1; tail -3 "$out/tiles-test.log"
common=(--max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3)
show() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass" "$1" | tail -"$2"; }
kv() { timeout "$1" python3 -m bench.throughput --preset "$2" "${@:3}" --out "$out/kvserve-$2.json" \
         > "$out/kvserve-$2.log" 2>&1; show "$out/kvserve-$2.log" 3; }
kv 90 wb "${common[@]}"
kv 100 wa "${common[@]}"
PYTHONPATH=/tmp/vllm-site timeout 170 python3 .carry/peers/vllm_bench.py --reps 3 > "$out/vllm-ab.log" 2>&1
grep RESULT "$out/vllm-ab.log" | cut -c1-220
cp "$out/kvserve-wb.json" "$out/kvserve-wb-1.json"; cp "$out/kvserve-wb.log" "$out/kvserve-wb-1.log"
kv 90 wb "${common[@]}"  # W-B again, after vLLM: W-B moved +-10% between processes before
