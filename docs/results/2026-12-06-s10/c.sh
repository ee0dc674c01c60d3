#!/usr/bin/env bash
# Tenth session, call C (a fresh machine: gpu-1, gpu-2 staged; carrying .carry/gpu-3 and .carry/extra): which host
# process W-B json 100% keeps busy through kvserve's server. The pair without vLLM, 4 repetitions, each load's
# cores busy per role recorded (bench/proc_cpu.py), with kvserve's defaults (4 front ends, 4 grammar
# processes on 16 cores), then 2 grammar processes, then 6 front ends (~2 min each).
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s10/c.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
run() {  # name, kvserve flags
  timeout $(( ${DEADLINE_S:-155} + 5 )) python3 benchmarks/online_pair.py --no-vllm --repeat 4 --deadline-s "${DEADLINE_S:-155}" --kvserve-args="$2" \
    --out "$out/pair-$1.json" --raw-dir "$out/raw-$1" > "$out/pair-$1.log" 2>&1
  echo "== $1 ($2)"; grep "^| W-B json [0-9]*% | kvserve" "$out/pair-$1.log"
  python3 -c "
import json, statistics as st, sys
runs = [r for r in json.load(open(sys.argv[1]))['runs'] if r['metrics'] and r['load'].startswith('W-B')]
for load in sorted({r['load'] for r in runs}):
    ms = [r['metrics'] for r in runs if r['load'] == load]
    roles = sorted({k for m in ms for k in m.get('cpu_cores', {})})
    cores = ', '.join(f\"{k} {st.median(m.get('cpu_cores', {}).get(k, 0) for m in ms):.2f}\" for k in roles)
    print(load, [round(m['output_throughput']) for m in ms], 'TPOT', [round(m['median_tpot_ms'], 1) for m in ms], '| cores:', cores)
" "$out/pair-$1.json"
}
# Servers as NAME=FLAGS arguments; none: the three this session ran. Next session's A/B, e.g.:
#   bash docs/results/2026-12-06-s10/c.sh "default=" "fill4=--structured-outputs-fill-threads 4"
[ $# -gt 0 ] || set -- "default=" "grammar2=--structured-outputs-processes 2" "front6=--api-server-count 6"
for server in "$@"; do
  run "${server%%=*}" "${server#*=}"
done
