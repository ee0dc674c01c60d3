#!/usr/bin/env bash
# Thirteenth session, call C (gpu-1..3 and vllm-1..4 staged on this machine): issue 19's W-L (8k prompts) through
# kvserve (auto: triton+flash-attn-4, 128-token pages) and vLLM 0.24.0 in one call, then W-L 32k (~8 min).
#   export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s13/c.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PYTHONPATH=/tmp/vllm-site python3 -c "import vllm" 2>/dev/null || { echo "vLLM is not staged" >&2; exit 3; }
show() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass" "$1" | tail -"$2"; }
timeout 100 python3 -m bench.throughput --preset wl --skip-tokenizer-init --repeat 3 --out "$out/kvserve-wl.json" \
  > "$out/kvserve-wl.log" 2>&1; show "$out/kvserve-wl.log" 3
PYTHONPATH=/tmp/vllm-site timeout 170 python3 benchmarks/vllm_wl.py --preset wl --repeat 3 \
  --out "$out/vllm-wl.json" > "$out/vllm-wl.log" 2>&1; show "$out/vllm-wl.log" 4
timeout 110 python3 -m bench.throughput --preset wl-32k --skip-tokenizer-init --repeat 2 --out "$out/kvserve-wl-32k.json" \
  > "$out/kvserve-wl-32k.log" 2>&1; show "$out/kvserve-wl-32k.log" 3
PYTHONPATH=/tmp/vllm-site timeout 170 python3 benchmarks/vllm_wl.py --preset wl-32k --repeat 2 \
  --out "$out/vllm-wl-32k.json" > "$out/vllm-wl-32k.log" 2>&1; show "$out/vllm-wl-32k.log" 4
