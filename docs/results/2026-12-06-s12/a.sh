#!/usr/bin/env bash
# Twelfth session, call A (gpu-1, gpu-2 staged; carrying .carry/gpu-3 and .carry/extra, which now holds py-spy):
# the pair without vLLM, W-B greedy as defined (earlier sessions sent no temperature: 1), REPEAT repetitions,
# kvserve's engine core sampled by py-spy over every load (benchmarks/online_pair.py --py-spy).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s12/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
lscpu | grep -E "^CPU\(s\)|Model name|Thread" | tee -a "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
pip install --target /tmp/pyspy --no-deps -q .carry/extra/py_spy-*.whl 2>&1 | grep -v WARNING | tail -2  # its own bin/
export PATH="/tmp/pyspy/bin:$PATH"
py-spy --version
name="${NAME:-new}"
timeout $(( ${DEADLINE_S:-300} + 10 )) python3 benchmarks/online_pair.py --no-vllm --repeat "${REPEAT:-6}" --py-spy \
  --deadline-s "${DEADLINE_S:-300}" --kvserve-args="${KVSERVE_ARGS:-}" --out "$out/pair-$name.json" \
  --raw-dir "$out/raw-$name" > "$out/pair-$name.log" 2>&1
grep "^| W-B json [0-9]*% | kvserve" "$out/pair-$name.log"
python3 - "$out/pair-$name.json" <<'PY'
import json, statistics as st, sys
runs = [r for r in json.load(open(sys.argv[1]))['runs'] if r['metrics'] and r['load'].startswith('W-B')]
for load in sorted({r['load'] for r in runs}):
    ms = [r['metrics'] for r in runs if r['load'] == load]
    es = [m.get('engine') or {} for m in ms]
    print(load, [round(m['output_throughput']) for m in ms], 'steps', [e.get('steps') for e in es])
    secs = {k: st.median(e.get('section_ms_per_step', {}).get(k, 0) for e in es) for k in es[0].get('section_ms_per_step', {})}
    print("   host ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in secs.items()))
    dev = {k: st.median(e.get('device_ms_per_step', {}).get(k, 0) for e in es) for k in es[0].get('device_ms_per_step', {})}
    print("   device ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in dev.items()))
PY
grep -E "^### py-spy|samples$" "$out/pair-$name.log"
