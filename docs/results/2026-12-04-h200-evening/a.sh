# Call A: GPU tests (warm-up: nothing compiles while serving; attention kernels), then the online pair
# (structured W-B 0/20/100% and TTFT 8k/32k alone, kvserve's server then vLLM's; vLLM with lm-format-enforcer staged).
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
pip install --target /tmp/vllm-site --no-deps -q .carry/vllm-extra/*.whl 2>&1 | grep -v WARNING | tail -2
t0=$SECONDS
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_warm_up_gpu.py tests/test_attention_gpu.py > $OUT/tests-a.log 2>&1; tail -1 $OUT/tests-a.log; grep -E "^FAILED|^E  " $OUT/tests-a.log | head -12
echo "tests $((SECONDS-t0)) s"
timeout 400 python3 benchmarks/online_pair.py --out $OUT/pair.json --raw-dir $OUT/pair-raw --deadline-s 390 > $OUT/pair.log 2>&1; grep -v "^\s*\$ \|Deprecat" $OUT/pair.log | tail -75
echo "pair $((SECONDS-t0)) s"
