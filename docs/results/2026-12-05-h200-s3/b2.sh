#!/usr/bin/env bash
# After `gpu_session.sh pair` on the same machine: issue 19's W-B and W-A through kvserve beside vLLM 0.24.0's
# offline engine in one call (~5 min). PYTHONPATH as b.sh; .carry/peers carried.
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
common=(--max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3)
show() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass" "$1" | tail -"$2"; }
kv() { timeout "$1" python3 -m bench.throughput --preset "$2" "${@:3}" --out "$out/kvserve-$2.json" \
         > "$out/kvserve-$2.log" 2>&1; show "$out/kvserve-$2.log" 3; }
kv 80 wb "${common[@]}"
kv 90 wa "${common[@]}"
PYTHONPATH=/tmp/vllm-site timeout 170 python3 .carry/peers/vllm_bench.py --reps 3 > "$out/vllm-ab.log" 2>&1
grep RESULT "$out/vllm-ab.log" | cut -c1-220
cp "$out/kvserve-wb.json" "$out/kvserve-wb-1.json"; cp "$out/kvserve-wb.log" "$out/kvserve-wb-1.log"
kv 80 wb "${common[@]}"  # W-B again after vLLM: it moved +-10% between processes before
