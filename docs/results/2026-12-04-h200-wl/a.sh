# Call A (issue 19): install extras, Triton tests on the new kernel, W-L attention kernels, the "before" W-L profile.
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
t0=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "triton" > $OUT/tests-triton.log 2>&1; tail -3 $OUT/tests-triton.log
echo "tests $((SECONDS-t0)) s"
timeout 200 python3 benchmarks/attention_kernels.py --only "(14/2 x 64) prefill" --iters 20 --out $OUT/attn-prefill.json > $OUT/attn-prefill.log 2>&1
grep "^|" $OUT/attn-prefill.log | tail -40
echo "attn $((SECONDS-t0)) s"
rm -rf /tmp/before && mkdir /tmp/before && cp -r attention engine bench benchmarks configs pyproject.toml /tmp/before/ && cp .carry/adhoc/before/triton_paged.py /tmp/before/attention/
(cd /tmp/before && PYTHONPATH=/tmp/before:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages timeout 200 python3 benchmarks/profile_workload.py --preset wl --attention-backend triton --windows 2-5,120-123 --out $OUT/wl-profile-before.json > $OUT/wl-profile-before.log 2>&1)
grep -v "Deprecat\|warn" $OUT/wl-profile-before.log | tail -45
echo "done $((SECONDS-t0)) s"
