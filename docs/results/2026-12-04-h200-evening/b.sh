# Call B: offline W-B, W-A, W-L, kvserve and vLLM 0.24.0 interleaved on one machine (per-repetition times kept).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
K=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
t0=$SECONDS
common="--max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3"
kv() { PYTHONPATH=$K timeout $1 python3 -m bench.throughput --preset $2 ${@:3} --out $OUT/kvserve-$2.json > $OUT/kvserve-$2.log 2>&1; python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(sys.argv[2], r['name'], 'out tok/s %.0f' % r['output_tokens_per_second'], 'total tok/s %.0f' % r['tokens_per_second'], 'runs_s', [round(x,3) for x in r['runs_s']])" $OUT/kvserve-$2.json $2 || tail -5 $OUT/kvserve-$2.log; echo "  at $((SECONDS-t0)) s"; }
kv 80 wb $common
kv 90 wa $common
PYTHONPATH=/tmp/vllm-site timeout 170 python3 .carry/peers/vllm_bench.py --reps 3 > $OUT/vllm-ab.log 2>&1; grep RESULT $OUT/vllm-ab.log | cut -c1-400; tail -3 $OUT/vllm-ab.log | grep -i error; echo "  at $((SECONDS-t0)) s"
kv 90 wl --skip-tokenizer-init --repeat 3
PYTHONPATH=/tmp/vllm-site timeout 170 python3 benchmarks/vllm_wl.py --preset wl --repeat 3 --out $OUT/vllm-wl.json > $OUT/vllm-wl.log 2>&1; grep "^vLLM" $OUT/vllm-wl.log; tail -3 $OUT/vllm-wl.log | grep -i error; echo "  at $((SECONDS-t0)) s"
