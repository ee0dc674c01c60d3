#!/usr/bin/env bash
# Fifteenth session, call C (gpu-1, gpu-2, vllm-1..4 staged; carrying .carry/gpu-3, .carry/extra, .carry/peers,
# .carry/vllm-extra): issue 15's pair beside vLLM's server as s14/b.sh runs it, without the masking tests
# first (the budget was short: they passed on the H100s with this code), W-B greedy, REPEAT repetitions.
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && REPEAT=5 DEADLINE_S=300 bash docs/results/2026-12-06-s15/c.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
lscpu | grep -E "^(CPU\\(s\\)|Model name|Thread\\(s\\)|Core\\(s\\)|Socket\\(s\\))" > "$out/lscpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
pip install --target /tmp/pyspy --no-deps -q .carry/extra/py_spy-*.whl 2>&1 | grep -v WARNING | tail -2
export PATH="/tmp/pyspy/bin:$PATH"
pip install --target /tmp/vllm-site --no-deps -q .carry/vllm-extra/*.whl 2>&1 | grep -v WARNING | tail -2
deadline="${DEADLINE_S:-300}"
timeout $((deadline + 15)) python3 benchmarks/online_pair.py --repeat "${REPEAT:-5}" --py-spy --out "$out/pair.json" \
  --raw-dir "$out/raw" --deadline-s "$deadline" > "$out/pair.log" 2>&1
grep -E "^\| (W-B|TTFT|load|prompt)|target|vLLM: (up|did)" "$out/pair.log"
tar czf "$out/raw.tgz" -C "$out" raw && rm -rf "$out/raw"
