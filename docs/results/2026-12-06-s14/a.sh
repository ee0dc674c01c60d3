#!/usr/bin/env bash
# Fourteenth session, call A (gpu-1, gpu-2 staged; carrying .carry/gpu-3 and .carry/extra): the masked argmax as
# one CUDA graph (engine/mask_kernel.py MaskedArgmaxGraphs) checked against the reference, then the pair without
# vLLM, W-B greedy, servers interleaved: the defaults, then --structured-outputs-argmax-graphs, then each again
# (s10/c.sh's runs, 4 repetitions each within DEADLINE_S; servers as NAME=FLAGS arguments, by default these four; the engine's host sections per load from s11/a.sh).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && DEADLINE_S=110 bash docs/results/2026-12-06-s14/a.sh
# Runs at 49cb94a (the flag it compares was reverted in d368efd).
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
lscpu | grep -E "^(CPU\(s\)|Model name|Thread\(s\)|Core\(s\)|Socket\(s\))" | tee "$out/lscpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_structured_masking.py tests/test_sampler.py \
  > "$out/tests.log" 2>&1
tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head
[ $# -gt 0 ] || set -- "base=" "graphs=--structured-outputs-argmax-graphs" "base2=" "graphs2=--structured-outputs-argmax-graphs"
OUT="$out" bash docs/results/2026-12-06-s11/a.sh "$@"
