#!/usr/bin/env bash
# Sixth session of 2026-12-05, call 1 on a machine: the grammar process (engine/grammar_link.py) against the
# matchers in the engine's process, offline W-B at json 100% (benchmarks/structured_step.py, alternated), and
# the CUDA test of the link. From the repository root, after staging gpu-1 and gpu-2, carrying .carry/gpu-3
# and .carry/extra:
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-s6/a.sh
set -u
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
timeout 60 python3 -m pytest -q -x tests/test_grammar_link.py -k cuda 2>&1 | tail -2
timeout 330 python3 benchmarks/structured_step.py --out "$out/variants.json" --variants \
  ${VARIANTS:-pipelined-0.2ms pipelined-0.2ms-inproc pipelined-0.2ms pipelined-0.2ms-inproc} 2>&1 \
  | grep -v "Loading\|Writing\|capturing\|Warning" | tail -8
true
