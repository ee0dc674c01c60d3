#!/usr/bin/env bash
# Twenty-fourth session, first call after staging gpu-1..3 (carrying .carry/extra): issue 15's kvserve half
# (k.sh, ten alternated repetitions), then the fused MLP kernel's tests on triton 3.6 (Owed 1 and 3).
#   bash docs/results/2026-12-07-s24/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out/k"
OUT="$out/k" bash docs/results/2026-12-07-s22/k.sh
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mlp_kernel.py 2>&1 | tail -5 | tee "$out/mlp.txt"
