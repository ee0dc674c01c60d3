#!/usr/bin/env bash
# Third call: the decode tiles' GPU tests, then issue 19's W-L (8k prompts) through kvserve and vLLM 0.24.0 in one call, then W-L 32k, one
# repetition each (~8 min). Staging and PYTHONPATH as b.sh.
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "decode_tiles or decode_ranges" \
  > "$out/tiles-test.log" 2>&1; tail -3 "$out/tiles-test.log"
show() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass" "$1" | tail -"$2"; }
timeout 100 python3 -m bench.throughput --preset wl --skip-tokenizer-init --repeat 3 --out "$out/kvserve-wl.json" \
  > "$out/kvserve-wl.log" 2>&1; show "$out/kvserve-wl.log" 3
PYTHONPATH=/tmp/vllm-site timeout 170 python3 benchmarks/vllm_wl.py --preset wl --repeat 3 \
  --out "$out/vllm-wl.json" > "$out/vllm-wl.log" 2>&1; show "$out/vllm-wl.log" 4
timeout 110 python3 -m bench.throughput --preset wl-32k --skip-tokenizer-init --repeat 2 --out "$out/kvserve-wl-32k.json" \
  > "$out/kvserve-wl-32k.log" 2>&1; show "$out/kvserve-wl-32k.log" 3
PYTHONPATH=/tmp/vllm-site timeout 170 python3 benchmarks/vllm_wl.py --preset wl-32k --repeat 2 \
  --out "$out/vllm-wl-32k.json" > "$out/vllm-wl-32k.log" 2>&1; show "$out/vllm-wl-32k.log" 4
