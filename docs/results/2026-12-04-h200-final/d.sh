# Call D (final): GPU tests of the block-128 / routing paths; W-L with the new defaults (auto: hybrid, 128-token
# pages on Hopper); the online pair (structured W-B and TTFT alone, kvserve's and vLLM's servers); W-L 32k; W-B.
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
t0=$SECONDS
show() { grep -v "Deprecat\|warn\|Writing\|Loading\|capturing\|exe_args" "$1" | tail -"$2"; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "long_prefill or hybrid" > $OUT/tests-d.log 2>&1; tail -1 $OUT/tests-d.log; grep -E "^FAILED|Error:" $OUT/tests-d.log | head -5
echo "tests $((SECONDS-t0)) s"
timeout 70 python3 -m bench.throughput --preset wl --skip-tokenizer-init --repeat 2 --out $OUT/kvserve-wl.json > $OUT/kvserve-wl.log 2>&1; show $OUT/kvserve-wl.log 1
echo "wl $((SECONDS-t0)) s"
timeout 275 python3 benchmarks/online_pair.py --out $OUT/pair.json --raw-dir $OUT/pair-raw --deadline-s 265 > $OUT/pair.log 2>&1; tail -40 $OUT/pair.log
echo "pair $((SECONDS-t0)) s"
timeout 70 python3 -m bench.throughput --preset wl-32k --skip-tokenizer-init --repeat 1 --out $OUT/kvserve-wl32k.json > $OUT/kvserve-wl32k.log 2>&1; show $OUT/kvserve-wl32k.log 1
echo "wl-32k $((SECONDS-t0)) s"
timeout 60 python3 -m bench.throughput --preset wb --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3 --out $OUT/kvserve-wb.json > $OUT/kvserve-wb.log 2>&1; show $OUT/kvserve-wb.log 1
echo "wb $((SECONDS-t0)) s"
