# Call C2 (issue 19, vLLM side, then kvserve W-L once more between): vLLM 0.24.0 W-L (+ prefill alone), W-L 32k.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$SECONDS
PYTHONPATH=/tmp/vllm-site timeout 200 python3 benchmarks/vllm_wl.py --preset wl --repeat 3 --prefill-repeat 2 --out $OUT/vllm-wl.json > $OUT/vllm-wl.log 2>&1; grep "^vLLM" $OUT/vllm-wl.log; tail -3 $OUT/vllm-wl.log | grep -i error
echo "vllm wl $((SECONDS-t0)) s"
PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages timeout 100 python3 -m bench.throughput --preset wl --skip-tokenizer-init --repeat 3 --out $OUT/kvserve-wl-2.json > $OUT/kvserve-wl-2.log 2>&1; grep "kvserve (" $OUT/kvserve-wl-2.log
echo "kvserve wl again $((SECONDS-t0)) s"
PYTHONPATH=/tmp/vllm-site timeout 240 python3 benchmarks/vllm_wl.py --preset wl-32k --repeat 2 --out $OUT/vllm-wl32k.json > $OUT/vllm-wl32k.log 2>&1; grep "^vLLM" $OUT/vllm-wl32k.log; tail -3 $OUT/vllm-wl32k.log | grep -i error
echo "done $((SECONDS-t0)) s"
