#!/bin/bash
# Session 6, machine session B part 1: every GPU test but the torch-backend ones (as gpu_session.sh tests).
set -u
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-./gpu-out}; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/gpu.txt
timeout 420 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_attention_gpu.py \
  tests/test_gpu_parity.py -k "not torch" > $O/gpu-tests.log 2>&1
grep -v "Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir\|exe_args" $O/gpu-tests.log | tail -25
