# Call C: the online pair again (kvserve's server now has fastapi-offline staged), (W-B's extra runs dropped: the device budget).
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
pip install --target /tmp/vllm-site --no-deps -q .carry/vllm-extra/*.whl 2>&1 | grep -v WARNING | tail -2
python3 -c "import server.app, server.launcher, server.cli, engine.grammar, llguidance, httptools; print('imports ok')" || exit 1
t0=$SECONDS
timeout 430 python3 benchmarks/online_pair.py --out $OUT/pair.json --raw-dir $OUT/pair-raw --deadline-s 420 > $OUT/pair.log 2>&1; grep -v "^\s*\$ \|Deprecat" $OUT/pair.log | tail -45
grep -n -m3 -A12 "Traceback" $OUT/pair-raw/vLLM-serve.log | head -45
echo "pair $((SECONDS-t0)) s"
