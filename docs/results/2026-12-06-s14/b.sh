#!/usr/bin/env bash
# Fourteenth session, call B (gpu-1, gpu-2, vllm-1..4 staged; carrying .carry/gpu-3, .carry/extra, .carry/peers,
# .carry/vllm-extra): the host's CPUs, then issue 15's pair beside vLLM's server as the twelfth session's b.sh
# runs it (W-B greedy, REPEAT repetitions interleaved, kvserve's engine core under py-spy), kvserve's server
# with KVSERVE_ARGS (more `kvserve serve` flags, none by default).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && REPEAT=7 DEADLINE_S=470 bash docs/results/2026-12-06-s14/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
lscpu | grep -E "^(CPU\\(s\\)|Model name|Thread\\(s\\)|Core\\(s\\)|Socket\\(s\\))" | tee "$out/lscpu.txt"
OUT="$out" bash docs/results/2026-12-06-s12/b.sh  # KVSERVE_ARGS: more `kvserve serve` flags (since this session)
