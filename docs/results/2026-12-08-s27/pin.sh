#!/usr/bin/env bash
# Is the W-B through the server noisy because the engine thread shares its CPU? Within one process the same
# load's decode ran at 2.4 to 6.0 ms a token (twenty-sixth session's k1, docs/benchmarks.md twenty-seventh).
# This runs docs/results/2026-12-08-s27/k.sh with the engine core's threads pinned to CPUs 0-1 and every other
# process of the server (front ends, grammar processes) and the clients kept off them, for a comparison with an
# unpinned k.sh in the same call (gpu-1..3 staged; carrying .carry/extra):
#   mkdir -p $OUT/u $OUT/p && REPEAT=5 OUT=$OUT/u bash docs/results/2026-12-08-s27/k.sh \
#     && REPEAT=5 OUT=$OUT/p bash docs/results/2026-12-08-s27/pin.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
pinner() {  # every second: the core's threads on 0-1, every other Python process (launcher, front ends, grammar
  local core  # processes, clients, this benchmark) on the rest
  while sleep 1; do
    core=$(pgrep -f "kvserve::engine-core")
    for pid in $core; do taskset -acp "${CORE_CPUS:-0-1}" "$pid" > /dev/null 2>&1; done
    for pid in $(pgrep -f "python|kvserve::"); do
      echo "$core" | grep -qx "$pid" || taskset -acp "${OTHER_CPUS:-2-$(( $(nproc) - 1 ))}" "$pid" > /dev/null 2>&1
    done
  done
}
pinner & pin_pid=$!
trap 'kill $pin_pid 2>/dev/null' EXIT
OUT="$out" bash docs/results/2026-12-08-s27/k.sh
for pid in $(pgrep -f "kvserve::engine-core"); do taskset -cp "$pid"; done | tee "$out/affinity.txt"
