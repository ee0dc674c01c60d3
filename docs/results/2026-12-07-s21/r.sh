#!/usr/bin/env bash
# Is kvserve's W-L slower than it was? The tenth session's H100 ran it in 2.146 s (vLLM 2.19 s); the twenty-first
# session's H100 in 2.29 s (vLLM 2.18 s). Here the tenth session's code (caec165) and HEAD, alternated, on one
# machine (~5 min; gpu-1..3 staged; carrying .carry/extra and .carry/old, made here first with
#   mkdir -p .carry/old && git archive caec165 attention bench benchmarks engine server | tar -x -C .carry/old
# ). A gap between them that holds across both rounds is a regression: bisect it with profile_workload.py.
#   bash docs/results/2026-12-07-s21/r.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
site=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
wl() {  # $1: the code's folder, $2: its tag
  (cd "$1" && PYTHONPATH=".:$site" PYTHONUNBUFFERED=1 timeout 150 python3 -m bench.throughput --preset wl \
     --skip-tokenizer-init --repeat 3 --out "$out/$2.json" > "$out/$2.log" 2>&1)
  echo "$2: $(grep -E '^kvserve' "$out/$2.log" | tail -1)"
}
for round in 1 2; do
  wl .carry/old "caec165-$round"
  wl . "head-$round"
done
