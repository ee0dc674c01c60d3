#!/usr/bin/env bash
# One H200 session: GPU tests, a decode-step profile, kvserve on the two standard workloads (W-A, W-B) with
# each GPU backend, then transformers on W-B, all logged under $OUT (or ./gpu-out). vLLM runs separately
# (shared/peers/vllm) on the same host right before or after; docs/benchmarks.md has the figures.
# Each part fits in one 10-minute device call: run them as separate calls, back to back.
# Usage: bash benchmarks/gpu_session.sh tests|profile|wb|wa|wl|wl-32k|wl-decode|wl-32k-decode [extra bench-throughput args...]
#        bash benchmarks/gpu_session.sh hf wb|wa generate|generate_batch|generate,generate_batch
#        bash benchmarks/gpu_session.sh vs-vllm   (W-B, W-A, W-L: kvserve and vLLM 0.24.0 interleaved, ~5.5 min;
#                                                   vs-vllm-ab: W-B, W-A and W-B again; vs-vllm-l: W-L)
#        bash benchmarks/gpu_session.sh tiles  (issue 19: decode tile variants, checked then timed, ~2 min)
#        bash benchmarks/gpu_session.sh first-rep  (issue 19: where the first repetition's time goes, ~3 min)
#        bash benchmarks/gpu_session.sh pair   (both servers: .carry/extra and .carry/vllm-extra carried, from
#                                               benchmarks/fetch_extra_wheels.sh; every .carry/vllm-K staged)
# (transformers on W-A runs ~2 min a repetition with generate_batch: one method per call there.)
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
what="${1:?tests|profile|wb|wa|wl|wl-32k|wl-decode|wl-32k-decode|hf|pair|vs-vllm|tiles|first-rep}"; shift || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
backends="${BACKENDS:-triton,flash-attn-4,triton+flash-attn-4}"
# Prefix caching is off in bench throughput by default (repetitions resend the same prompts).
common=(--max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 256 --skip-tokenizer-init --repeat 3)
# Full logs under $OUT; only their tails here (the CUTLASS DSL prints many deprecation warnings).
show() { grep -v "Loading weights\|Writing model\|capturing\|Deprecat\|LayoutEnum\|OperandMajor\|from cutlass" "$1" | tail -"$2"; }
# Parts that run vLLM check first that it is staged (vllm-1..4 on this machine): a machine released between
# the staging calls and this one comes back bare, and the kvserve half would spend minutes for no ratio.
case "$what" in
  vs-vllm*|wl|wl-32k|wl-decode|wl-32k-decode)
    PYTHONPATH=/tmp/vllm-site python3 -c "import vllm" 2>/dev/null \
      || { echo "vLLM is not staged on this machine (stage vllm-1..4 again: the machine was fresh)" >&2; exit 3; } ;;
esac
# The engine imports msgspec and pyzmq (its grammar process's messages), which the gpu-1..3 folders lack: the
# twenty-first session's W-L runs stopped there. .carry/extra (benchmarks/fetch_extra_wheels.sh) has both.
case "$what" in
  wb|wa|wl*|vs-vllm*|profile|first-rep|hf|pair)
    [ -d .carry/extra ] && pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
    python3 -c "import engine.setup" 2>/dev/null \
      || { echo "kvserve's engine does not import here (msgspec, pyzmq?): carry .carry/extra" >&2; exit 3; } ;;
esac
case "$what" in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
    timeout 500 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_attention_gpu.py \
      tests/test_gpu_parity.py -k "not torch" > "$out/gpu-tests.log" 2>&1
    show "$out/gpu-tests.log" 30 ;;
  profile)
    timeout 500 python3 benchmarks/profile_step.py --attention-backend "$backends" --out "$out/profile.json" \
      > "$out/profile.log" 2>&1
    show "$out/profile.log" 80 ;;
  wb|wa)
    timeout 560 python3 -m bench.throughput --preset "$what" --attention-backend "$backends" \
      "${common[@]}" "$@" --out "$out/kvserve-$what.json" > "$out/kvserve-$what.log" 2>&1
    show "$out/kvserve-$what.log" 30 ;;
  wl|wl-32k|wl-decode|wl-32k-decode)
    # W-L (issue 19): long prompts (-decode: 1,024 output tokens); the preset sets max-model-len / max-num-batched-tokens, vLLM right after.
    timeout 400 python3 -m bench.throughput --preset "$what" --attention-backend "${BACKENDS:-auto}" \
      --skip-tokenizer-init --repeat "${REPEAT:-3}" "$@" --out "$out/kvserve-$what.json" > "$out/kvserve-$what.log" 2>&1
    show "$out/kvserve-$what.log" 12
    PYTHONPATH=/tmp/vllm-site timeout 400 python3 benchmarks/vllm_wl.py --preset "$what" --repeat "${REPEAT:-3}" \
      --out "$out/vllm-$what.json" > "$out/vllm-$what.log" 2>&1
    show "$out/vllm-$what.log" 6 ;;
  hf)
    preset="${1:-wb}"; methods="${2:-generate,generate_batch}"; tag="hf-$preset-${methods//,/-}"
    # HF_WITH_KVSERVE="" skips the kvserve rerun beside it (transformers alone, when the device budget is short).
    timeout 580 python3 -m bench.throughput --preset "$preset" --attention-backend "${HF_WITH_KVSERVE-${backends%%,*}}" \
      --compare-hf "$methods" "${common[@]}" --out "$out/$tag.json" > "$out/$tag.log" 2>&1
    show "$out/$tag.log" 20 ;;
  vs-vllm|vs-vllm-ab|vs-vllm-l)
    # Issue 19's "W-A and W-B stay >= 1.8x, W-L >= 1.2x", in one call: each kvserve run beside vLLM's
    # (-ab: W-B, W-A, vLLM's both, W-B again; -l: W-L and vLLM's; vs-vllm: both halves, ~5.5 min).
    kv() { timeout "$1" python3 -m bench.throughput --preset "$2" "${@:3}" --out "$out/kvserve-$2$KV_TAG.json" \
             > "$out/kvserve-$2$KV_TAG.log" 2>&1; show "$out/kvserve-$2$KV_TAG.log" 2; }
    KV_TAG=""
    if [ "$what" != vs-vllm-l ]; then
      kv 90 wb "${common[@]}"
      kv 100 wa "${common[@]}"
      PYTHONPATH=/tmp/vllm-site timeout 170 python3 .carry/peers/vllm_bench.py --reps 3 > "$out/vllm-ab.log" 2>&1
      grep RESULT "$out/vllm-ab.log" | cut -c1-220
    fi
    if [ "$what" = vs-vllm-ab ]; then
      KV_TAG="-after"; kv 90 wb "${common[@]}"  # W-B moved +-10% between processes before
    fi
    if [ "$what" != vs-vllm-ab ]; then
      kv 100 wl --skip-tokenizer-init --repeat 3
      PYTHONPATH=/tmp/vllm-site timeout 170 python3 benchmarks/vllm_wl.py --preset wl --repeat 3 \
        --out "$out/vllm-wl.json" > "$out/vllm-wl.log" 2>&1
      show "$out/vllm-wl.log" 5
    fi ;;
  tiles)
    # Issue 19's largest W-L lever: the Triton decode tile variants, checked against the reference, then
    # timed beside the shipped tiles on W-L's decode shape at 16- and 128-token pages (~2 min).
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py \
      -k "test_triton_decode_tiles_match_reference or even_splits" > "$out/tiles-test.log" 2>&1
    show "$out/tiles-test.log" 5
    grep -q " passed" "$out/tiles-test.log" && ! grep -q " failed" "$out/tiles-test.log" || exit 1
    timeout 300 python3 benchmarks/attention_kernels.py --only "decode 64" --block-size 16,128 \
      --backends triton,triton+flash-attn-4 --out "$out/tiles.json" > "$out/tiles.log" 2>&1
    show "$out/tiles.log" 30 ;;
  first-rep)
    # Issue 19: W-A's and W-B's first timed repetition runs 0.1-0.2 s slower, and it is not a compile.
    # benchmarks/first_rep.py times every step of repetition 1 beside the same step of the last one; W-B runs
    # again with CUDA's eager module loading (lazy loading is one candidate) (~3 min).
    for run in "wb LAZY" "wa LAZY" "wb EAGER"; do
      set -- $run
      CUDA_MODULE_LOADING=$2 timeout 150 python3 benchmarks/first_rep.py --preset "$1" --repeat 3 \
        --out "$out/first-rep-$1-$2.json" > "$out/first-rep-$1-$2.log" 2>&1
      echo "== $1, CUDA_MODULE_LOADING=$2"; show "$out/first-rep-$1-$2.log" 18
    done ;;
  pair)
    # Issue 15's structured W-B at 0/20/100% and issue 19's TTFT of 8k/32k prompts alone, through kvserve's
    # server and then vLLM's (~6 min: vLLM's server takes ~100-120 s to start).
    pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
    pip install --target /tmp/vllm-site --no-deps -q .carry/vllm-extra/*.whl 2>&1 | grep -v WARNING | tail -2
    python3 -c "import server.app, server.launcher, llguidance, httptools" || exit 1
    python3 -c "import xgrammar" 2>/dev/null && echo "xgrammar: JSON masks" || echo "no xgrammar: llguidance masks"
    deadline="${PAIR_DEADLINE_S:-430}"  # the pair's whole run; the call's limit is 600 s
    timeout $((deadline + 20)) python3 benchmarks/online_pair.py --out "$out/pair.json" --raw-dir "$out/pair-raw" \
      --deadline-s "$deadline" "$@" > "$out/pair.log" 2>&1
    show "$out/pair.log" 45 ;;
  *) echo "unknown part $what: tests|profile|wb|wa|wl|wl-32k|wl-decode|wl-32k-decode|hf|pair|vs-vllm[-ab|-l]|tiles|first-rep" >&2; exit 2 ;;
esac
