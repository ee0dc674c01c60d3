#!/usr/bin/env bash
# Tenth session, call A: the ninth session's a.sh (as run in call A; from the next session on with 5
# repetitions of the pair, the json 100% load being bimodal across repetitions) (after staging gpu-1, gpu-2, vllm-1..4; carrying
# .carry/gpu-3, .carry/extra, .carry/peers, .carry/vllm-extra): the mask kernels checked and timed, then issue
# 15's W-B at json 0/20/100% through kvserve's server and vLLM 0.24.0's, 3 repetitions (~6.5 min).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s10/a.sh
# The host's CPUs: whether its 16 are 8 cores with two hardware threads each (the engine's poll for masks, the
# grammar processes' fill threads and the front ends would then share cores).
mkdir -p "${OUT:-./gpu-out}" && lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA node)" | tee "${OUT:-./gpu-out}/lscpu.txt"
REPEAT="${REPEAT:-5}" PAIR_DEADLINE_S="${PAIR_DEADLINE_S:-500}" exec bash "$(dirname "$0")/../2026-12-06-s9/a.sh"
