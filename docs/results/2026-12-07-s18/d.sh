#!/usr/bin/env bash
# Eighteenth session, call D, the last of the budget (a fresh machine; carrying .carry/server, now with apache-tvm-ffi
# so xgrammar imports: call C's server ran llguidance for every mask, .carry/extra): which host calls block behind
# the device's wait (sync_probe.py: a torch kernel's first launch?), then kvserve alone, W-B greedy json 0/20/100%,
# the device waiting for the masks, then the host (pipeline), in what is left of LIMIT_S.
#   LIMIT_S=400 bash docs/results/2026-12-07-s18/d.sh      (WAITS=device: that variant only)
set -u
out="${OUT:-./gpu-out}"; start=$(date +%s); mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/server/*.whl .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import xgrammar; print('xgrammar', xgrammar.__version__)" 2>&1 | tail -1
timeout -s KILL 70 python3 docs/results/2026-12-07-s18/sync_probe.py nothing fresh-torch-kernel loaded-torch-kernel \
  pinned-alloc pageable-h2d cuda-alloc 2>&1 | grep -v "Warning\|warn(" | tee "$out/sync_probe.txt"
waits="${WAITS:-device pipeline}"; n=$(echo $waits | wc -w)
each=$(( (${LIMIT_S:-400} - 10 - $(date +%s) + start) / n - 10 ))
for wait in $waits; do
  echo "== $wait: ${each} s"
  timeout $((each + 8)) python3 benchmarks/online_pair.py --no-vllm --repeat 3 --deadline-s "$each" \
    --min-phase-s 40 --kvserve-args "--structured-outputs-wait $wait" --out "$out/$wait.json" \
    --raw-dir "$out/raw-$wait" > "$out/$wait.log" 2>&1
  grep -E "^\| (W-B|load)" "$out/$wait.log" | cut -c1-200
  grep -E "json 100% #" "$out/$wait.log" | sed 's/.*cores busy/cores busy/' | cut -c1-700
done
grep -h "grammar masks\|structured outputs:\|Traceback\|Error" "$out"/raw-*/kvserve-serve.log 2>/dev/null | cut -c25- | sort | uniq -c | head -8
tar czf "$out/raw.tgz" -C "$out" raw-device raw-pipeline 2>/dev/null && rm -rf "$out"/raw-*
