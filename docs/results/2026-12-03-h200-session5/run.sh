#!/bin/bash
# One device session: triton's length-split decode checked against the reference, then W-A/W-B end to end
# with and without it (profile_workload), then the kernel micro-benchmark.
set -u
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-./gpu-out}; mkdir -p $O
f() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|USDT\|warn"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "triton and (decode_ranges or split_kv or padded_decode or mixed_batch or graph)" > $O/tests.log 2>&1; tail -4 $O/tests.log
timeout 170 python3 benchmarks/profile_workload.py --preset wa,wb --attention-backend triton --triton-decode-split-keys 256,1000000000 --out $O/wa-wb.json > $O/profile.log 2>&1; f < $O/profile.log | tail -75
timeout 50 python3 benchmarks/attention_kernels.py --only "qwen2.5-0.5b (14/2 x 64) decode" --iters 30 --out $O/kernels.json > $O/kernels.log 2>&1; grep "^|" $O/kernels.log | sort -u
