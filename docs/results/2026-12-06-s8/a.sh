#!/usr/bin/env bash
# Eighth session, call A (after staging gpu-1, gpu-2; carrying .carry/gpu-3 and .carry/extra): W-B at json 0% and
# 100% through the real server with the engine's host sections and the grammar processes' own accept / fill
# times, with 1, 4 and 2 grammar processes (benchmarks/server_step_profile.py, ~70 s each).
#   bash .carry/gpu-3/stage.sh && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s8/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
for n in ${PROCESSES:-1 4 2}; do
  echo "== $n grammar process(es)"
  timeout 170 python3 benchmarks/server_step_profile.py --repeat 1 --engine-args "{\"structured_outputs_processes\": $n}" \
    --out "$out/server_step_profile-p$n.json" > "$out/server_step_profile-p$n.log" 2>&1
  grep "^W-B" "$out/server_step_profile-p$n.log"
done
