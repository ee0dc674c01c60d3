#!/usr/bin/env bash
# Issue 15's W-B pair (docs/results/2026-12-07-s22/k.sh) with the engine's step trace on (--step-trace): why the
# same load runs in 136 steps one repetition and 255-265 the next (gpu-1..3 staged; carrying .carry/extra).
#   mkdir -p $OUT/k1 && REPEAT=10 OUT=$OUT/k1 bash docs/results/2026-12-08-s27/k.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
python3 -c "import flash_attn.cute, xgrammar, zmq, msgspec" || exit 3
timeout -s KILL 400 python3 benchmarks/online_pair.py --no-vllm --repeat "${REPEAT:-10}" --out "$out/pair.json" \
  --raw-dir "$out/raw" --deadline-s 360 --kvserve-args "--step-trace $(realpath "$out")/trace.csv ${KVSERVE_ARGS:-}" \
  > "$out/pair.log" 2>&1
grep -E "^\| (W-B|TTFT|load|prompt)|target" "$out/pair.log" | cut -c1-400
python3 benchmarks/step_trace_report.py "$out/trace.csv" --min-rows 16 --json "$out/trace_loads.json" --plot "$out/trace.png" \
  | head -60
gzip -f "$out/trace.csv"
tar czf "$out/raw.tgz" -C "$out" raw && rm -rf "$out/raw"
