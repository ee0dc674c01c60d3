#!/usr/bin/env bash
# Issue 15's W-B pair (docs/results/2026-12-07-s22/k.sh) with the engine's step trace on (--step-trace): which
# steps are small and how long each decode step takes (gpu-1..3 staged; carrying .carry/extra).
#   mkdir -p $OUT/k1 && REPEAT=10 OUT=$OUT/k1 bash docs/results/2026-12-08-s27/k.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
KVSERVE_ARGS="--step-trace $(realpath "$out")/trace.csv ${KVSERVE_ARGS:-}" OUT="$out" \
  bash docs/results/2026-12-07-s22/k.sh
PYTHONPATH=. python3 benchmarks/step_trace_report.py "$out/trace.csv" --min-rows 16 --json "$out/trace_loads.json" \
  --plot "$out/trace.png" | head -60
gzip -f "$out/trace.csv"
