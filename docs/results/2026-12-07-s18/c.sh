#!/usr/bin/env bash
# Eighteenth session, call C (a fresh machine, nothing staged; carrying .carry/server, .carry/extra, .carry/tok;
# .carry/server: gpu-1..3's wheels less flash-attn-4 and CUTLASS's DSL, so the server runs with Triton's attention,
# which the hybrid also runs on W-B's steps, and no staging call is needed): g.sh (the gate:
# which host calls block behind the wait, its kernel-level and engine tests), then kvserve alone through its
# server, W-B greedy json 0/20/100%, the device waiting for the masks, then the host waiting (pipeline), in what
# is left of a 600 s call. Issue 15's bar: json 100% >= 0.9x json 0%.
#   bash docs/results/2026-12-07-s18/c.sh
set -u
out="${OUT:-./gpu-out}"; start=$(date +%s)
pip install --target /tmp/site --no-deps -q .carry/server/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site
SKIP_PROBE=1 LINK_S=150 OUT="$out/g" bash docs/results/2026-12-07-s18/g.sh
each=$(( (570 - $(date +%s) + start) / 2 - 15 ))
for wait in device pipeline; do
  echo "== $wait: ${each} s"
  timeout $((each + 10)) python3 benchmarks/online_pair.py --no-vllm --repeat "${REPEAT:-3}" --deadline-s "$each" \
    --min-phase-s 40 --kvserve-args "--structured-outputs-wait $wait" --out "$out/$wait.json" \
    --raw-dir "$out/raw-$wait" > "$out/$wait.log" 2>&1
  grep -E "^\| (W-B|load)|json 100% #|json 0% #" "$out/$wait.log" | cut -c1-300
done
grep -h "grammar masks\|Traceback\|Error" "$out"/raw-*/kvserve-serve.log 2>/dev/null | sort | uniq -c | head -8
tar czf "$out/raw.tgz" -C "$out" raw-device raw-pipeline 2>/dev/null && rm -rf "$out"/raw-*
