#!/bin/bash
# Session 6, machine session B part 2: vLLM's warm-up process, kvserve (bench throughput, 3 reps, median;
# triton and flash-attn-4) on W-A and W-B, vLLM's measured process, then kvserve's step groups (triton).
set -u
O=${OUT:-./gpu-out}; mkdir -p $O
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
f() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir\|exe_args\|USDT\|warn"; }
PYTHONPATH=/tmp/vllm-site timeout 150 python3 .carry/peers/vllm_bench.py --reps 1 > $O/vllm-warm.log 2>&1; grep RESULT $O/vllm-warm.log | cut -c1-200
for w in wa wb; do
  PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages timeout 200 python3 -m server.bench_throughput --preset $w \
    --attention-backend triton,flash-attn-4 --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 \
    --skip-tokenizer-init --repeat 3 --out $O/kvserve-$w.json > $O/kvserve-$w.log 2>&1
  f < $O/kvserve-$w.log | tail -4
done
PYTHONPATH=/tmp/vllm-site timeout 200 python3 .carry/peers/vllm_bench.py --reps 3 > $O/vllm.log 2>&1; grep RESULT $O/vllm.log | cut -c1-200
PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages timeout 120 python3 benchmarks/profile_workload.py --preset wa,wb \
  --attention-backend triton --windows "" --out $O/wa-wb.json --plot $O/groups.png > $O/profile.log 2>&1; f < $O/profile.log | tail -22
