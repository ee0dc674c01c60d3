#!/bin/bash
# Session 6, machine session A: the decode-only split path checked on the H200, then W-A/W-B per step group
# for triton (default split choice) and flash-attn-4.
set -u
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-./gpu-out}; mkdir -p $O
f() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|USDT\|warn"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py tests/test_kernels.py -k "triton" > $O/tests.log 2>&1; tail -4 $O/tests.log
timeout 300 python3 benchmarks/profile_workload.py --preset wa,wb --attention-backend triton,flash-attn-4 --windows "" --out $O/wa-wb.json --plot $O/groups.png > $O/profile.log 2>&1; f < $O/profile.log | tail -40
