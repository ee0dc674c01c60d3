#!/usr/bin/env bash
# Twelfth session, call B (gpu-1, gpu-2, vllm-1..4 staged; carrying .carry/gpu-3, .carry/extra, .carry/peers,
# .carry/vllm-extra): issue 15's pair beside vLLM's server, W-B greedy as defined, REPEAT repetitions, kvserve's
# engine core sampled by py-spy over every load; the masking kernel's tests first.
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s12/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
pip install --target /tmp/pyspy --no-deps -q .carry/extra/py_spy-*.whl 2>&1 | grep -v WARNING | tail -2  # its own bin/
export PATH="/tmp/pyspy/bin:$PATH"
py-spy --version
pip install --target /tmp/vllm-site --no-deps -q .carry/vllm-extra/*.whl 2>&1 | grep -v WARNING | tail -2
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_structured_masking.py tests/test_sampler.py > "$out/tests.log" 2>&1
tail -1 "$out/tests.log"
deadline="${DEADLINE_S:-470}"
timeout $((deadline + 15)) python3 benchmarks/online_pair.py --repeat "${REPEAT:-5}" --py-spy --kvserve-args="${KVSERVE_ARGS:-}" --out "$out/pair.json" \
  --raw-dir "$out/raw" --deadline-s "$deadline" > "$out/pair.log" 2>&1
grep -E "^\| (W-B|TTFT|load|prompt)|target|vLLM: (up|did)" "$out/pair.log"
python3 - "$out/pair.json" <<'PY'
import json, statistics as st, sys
runs = [r for r in json.load(open(sys.argv[1]))['runs'] if r['metrics'] and r['load'].startswith('W-B')]
for sysname in ('kvserve', 'vLLM'):
    for load in sorted({r['load'] for r in runs}):
        ms = [r['metrics'] for r in runs if r['load'] == load and r['system'] == sysname]
        print(sysname, load, [round(m['output_throughput']) for m in ms])
PY
tar czf "$out/raw.tgz" -C "$out" raw && rm -rf "$out/raw"  # one file: a call brings back only so many
