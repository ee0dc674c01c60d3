# Call C1 (issue 19, final kvserve side): tests of the routing and decode ranges, W-L / W-L 32k / W-B / W-A with auto.
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
t0=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "hybrid or decode_ranges or padded_decode" > $OUT/tests-c1.log 2>&1; tail -2 $OUT/tests-c1.log
echo "tests $((SECONDS-t0)) s"
show() { grep -v "Deprecat\|warn\|Writing\|Loading\|capturing\|exe_args" "$1" | tail -"$2"; }
timeout 120 python3 -m bench.throughput --preset wl --skip-tokenizer-init --repeat 3 --out $OUT/kvserve-wl.json > $OUT/kvserve-wl.log 2>&1; show $OUT/kvserve-wl.log 4
echo "wl $((SECONDS-t0)) s"
timeout 200 python3 -m bench.throughput --preset wl-32k --skip-tokenizer-init --repeat 2 --out $OUT/kvserve-wl32k.json > $OUT/kvserve-wl32k.log 2>&1; show $OUT/kvserve-wl32k.log 4
echo "wl-32k $((SECONDS-t0)) s"
for p in wb wa; do
  timeout 150 python3 -m bench.throughput --preset $p --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3 --out $OUT/kvserve-$p.json > $OUT/kvserve-$p.log 2>&1; show $OUT/kvserve-$p.log 3
  echo "$p $((SECONDS-t0)) s"
done
