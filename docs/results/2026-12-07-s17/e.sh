#!/usr/bin/env bash
# Seventeenth session, call E (right after d.sh on the same machine; gpu-1, gpu-2 staged; carrying .carry/gpu-3,
# .carry/extra): kvserve alone through its server, the host waiting for the masks against the device waiting (b.sh).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && REPEAT=3 bash docs/results/2026-12-07-s17/e.sh
set -u
out="${OUT:-./gpu-out}"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
OUT="$out/ab" bash docs/results/2026-12-07-s17/b.sh
