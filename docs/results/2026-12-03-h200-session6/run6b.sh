#!/bin/bash
# Session 6, machine session A part 2: vLLM (a warm-up process, then the measured one), then kvserve's
# bench throughput (3 reps, median) with triton and flash-attn-4, W-A and W-B, on the same host.
set -u
O=${OUT:-./gpu-out}; mkdir -p $O
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
(PYTHONPATH=/tmp/vllm-site timeout 150 python3 .carry/peers/vllm_bench.py --reps 1 > $O/vllm-warm.log 2>&1); grep RESULT $O/vllm-warm.log
PYTHONPATH=/tmp/vllm-site timeout 200 python3 .carry/peers/vllm_bench.py --reps 3 > $O/vllm.log 2>&1; grep RESULT $O/vllm.log
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
for w in wa wb; do
  timeout 200 python3 -m server.bench_throughput --preset $w --attention-backend triton,flash-attn-4 --max-model-len 2048 \
    --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3 --out $O/kvserve-$w.json > $O/kvserve-$w.log 2>&1
  grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir" $O/kvserve-$w.log | tail -8
done
