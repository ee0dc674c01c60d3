#!/usr/bin/env bash
# Sixth session of 2026-12-05, last device minutes: issue 15's structured W-B at 0/20/100% through kvserve's
# server alone, with the grammar process (the default with CUDA), one repetition (~4 min). vLLM's side is in
# b.sh (not run: the budget left did not cover it). After staging gpu-1 and gpu-2, carrying .carry/gpu-3 and
# .carry/extra:
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-s6/c.sh
set -u
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/online_pair.py --no-vllm --repeat 1 --deadline-s 190 --min-phase-s 60 \
  --out "$out/pair.json" --raw-dir "$out/pair-raw" "$@" > "$out/pair.log" 2>&1
grep -v "Loading\|Writing" "$out/pair.log" | tail -22
