#!/usr/bin/env bash
# Eighteenth session, call B (gpu-1, gpu-2, vllm-1..4 staged; carrying .carry/gpu-3, .carry/extra, .carry/tok,
# .carry/peers, .carry/vllm-extra): g.sh (the gate: which host calls block behind the wait, its kernel-level and
# engine tests), then a.sh (issue 15's pair beside vLLM's server, kvserve with --structured-outputs-wait device,
# which falls back to the host's wait if the gate fails its check) in what is left of a 600 s call.
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && bash docs/results/2026-12-07-s18/b.sh
set -u
out="${OUT:-./gpu-out}"; start=$(date +%s)
SKIP_PROBE=1 LINK_S=150 OUT="$out/g" bash docs/results/2026-12-07-s18/g.sh
left=$((580 - $(date +%s) + start))
echo "== pair: ${left} s left"
REPEAT="${REPEAT:-3}" DEADLINE_S=$((left - 20)) OUT="$out/a" bash docs/results/2026-12-07-s18/a.sh
