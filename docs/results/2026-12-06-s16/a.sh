#!/usr/bin/env bash
# Sixteenth session, call A (gpu-1, gpu-2, vllm-1..4 staged; carrying .carry/gpu-3, .carry/extra, .carry/peers,
# .carry/vllm-extra), one call for the two owed H200 measurements that fit in ten minutes:
#   1. issue 15's pair beside vLLM's server (docs/results/2026-12-06-s15/c.sh: W-B greedy json 0/20/100%),
#   2. issue 19's TMA decode kernel against the pointer kernel (docs/results/2026-12-06-s13/a.sh), on an H200 only.
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && REPEAT=5 DEADLINE_S=280 bash docs/results/2026-12-06-s16/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out/pair" "$out/tma"
OUT="$out/pair" bash docs/results/2026-12-06-s15/c.sh
if grep -q H200 "$out/pair/gpu.txt"; then
  OUT="$out/tma" bash docs/results/2026-12-06-s13/a.sh
fi
