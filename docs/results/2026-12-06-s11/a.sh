#!/usr/bin/env bash
# Eleventh session, call A (gpu-1, gpu-2 staged; carrying .carry/gpu-3 and .carry/extra): the pair without vLLM,
# 4 repetitions per server, with the engine thread's milliseconds a step by section (engine/step_clock.py) per
# load, for the servers given as NAME=FLAGS (s10/c.sh), e.g.
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s11/a.sh "default=" "nospin=--structured-outputs-spin-ms 0"
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
bash "$(dirname "$0")/../2026-12-06-s10/c.sh" "$@"
for server in "$@"; do
  name="${server%%=*}"
  echo "== $name: engine figures per load (medians over the repetitions)"
  python3 - "$out/pair-$name.json" <<'PY'
import json, statistics as st, sys
runs = [r for r in json.load(open(sys.argv[1]))['runs'] if r['metrics'] and r['load'].startswith('W-B')]
for load in sorted({r['load'] for r in runs}):
    es = [r['metrics'].get('engine') or {} for r in runs if r['load'] == load]
    med = lambda k: st.median(e.get(k, 0) for e in es)
    secs = {k: st.median(e.get('section_ms_per_step', {}).get(k, 0) for e in es) for k in es[0].get('section_ms_per_step', {})}
    print(f"{load}: steps {med('steps')}, tokens/step {med('tokens_per_step')}, busy {med('busy_ms_per_step'):.2f} ms/step,"
          f" share {med('busy_share')}, mask wait {med('mask_wait_ms_per_masked_step'):.2f} ms/masked step ({med('masked_steps')})")
    print("   host ms/step: " + ", ".join(f"{k} {v:.3f}" for k, v in secs.items()))
    dev = {k: st.median(e.get('device_ms_per_step', {}).get(k, 0) for e in es) for k in es[0].get('device_ms_per_step', {})}
    print("   device ms/step: " + ", ".join(f"{k} {v:.3f}" for k, v in dev.items()))
PY
done
