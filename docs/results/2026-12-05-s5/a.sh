#!/usr/bin/env bash
# Fifth session of 2026-12-05, call 1 on a machine: where a constrained step's time goes, offline, for the
# two step loops (serial: sampled in the step() that launched it; pipelined: after the next step is
# scheduled and staged) at CPython's default 5 ms switch interval and at 0.2 ms, alternated. The choice of
# loop for b.sh is left in /tmp/kvserve-variants.json (the machine keeps /tmp while warm).
# From the repository root, after staging gpu-1 and gpu-2, carrying .carry/gpu-3 and .carry/extra:
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-s5/a.sh
set -u
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
timeout 320 python3 benchmarks/structured_step.py --out "$out/variants.json" --variants \
  ${VARIANTS:-pipelined-0.2ms serial-0.2ms pipelined-0.2ms} 2>&1 \
  | grep -v "Loading\|Writing\|capturing\|Warning" | tail -12
cp "$out/variants.json" /tmp/kvserve-variants.json 2>/dev/null
# The grammar-process lever on this host's 16 cores (~20 s): the engine thread's grammar work and wait per
# step, in-process against a process of its own (benchmarks/grammar_process.py).
timeout 90 python3 benchmarks/grammar_process.py --batch 256 --steps 40 --window-ms 2.5 \
  --out "$out/grammar_process.json" 2>&1 | grep -v Warning | tail -3
true
