# Call B1 (issue 19): GPU tests of the changed kernels, the "after" W-L profiles (triton, hybrid).
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
t0=$SECONDS
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_attention_gpu.py -k "rope or hybrid or flash-attn-4 or graph" > $OUT/tests-b1.log 2>&1; tail -4 $OUT/tests-b1.log; grep -E "FAIL|Error" $OUT/tests-b1.log | head -10
echo "tests $((SECONDS-t0)) s"
timeout 300 python3 benchmarks/profile_workload.py --preset wl --attention-backend triton,triton+flash-attn-4 --windows 2-5,120-123 --out $OUT/wl-profile-after.json > $OUT/wl-profile-after.log 2>&1
grep -v "Deprecat\|warn\|Writing\|Loading\|capturing" $OUT/wl-profile-after.log | tail -62
echo "done $((SECONDS-t0)) s"
