# Call B2: W-A and W-B stay where they are? triton against the per-step hybrid; decode kernels at W-L contexts.
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$SECONDS
for p in wb wa; do
  timeout 260 python3 -m bench.throughput --preset $p --attention-backend triton,triton+flash-attn-4 --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3 --out $OUT/kvserve-$p.json > $OUT/kvserve-$p.log 2>&1
  grep -v "Deprecat\|warn\|Writing\|Loading\|capturing" $OUT/kvserve-$p.log | tail -8
  echo "$p $((SECONDS-t0)) s"
done
timeout 150 python3 benchmarks/attention_kernels.py --only "(14/2 x 64) decode 64" --iters 20 --out $OUT/attn-decode.json > $OUT/attn-decode.log 2>&1
grep "^|" $OUT/attn-decode.log | tail -16
echo "done $((SECONDS-t0)) s"
