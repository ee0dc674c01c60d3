#!/usr/bin/env bash
# Seventeenth session, call B (right after A, the same machine: /tmp/site and /tmp/vllm-site still there; carrying
# .carry/extra): kvserve alone, the host waiting for the masks (--structured-outputs-wait pipeline, the sixteenth
# session's code path) then the device waiting (the default), W-B greedy json 0/20/100%, REPEAT each, back to back.
#   export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && REPEAT=4 bash docs/results/2026-12-07-s17/b.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
for wait in pipeline device; do
  timeout 250 python3 benchmarks/online_pair.py --no-vllm --repeat "${REPEAT:-4}" --deadline-s 220 \
    --kvserve-args "--structured-outputs-wait $wait" --out "$out/$wait.json" --raw-dir "$out/raw-$wait" \
    > "$out/$wait.log" 2>&1
  echo "== $wait"
  grep -E "^\| (W-B|load)|json 100% #|json 0% #" "$out/$wait.log" | cut -c1-420
done
grep -h "grammar masks\|Traceback\|Error" "$out"/raw-*/kvserve-serve.log 2>/dev/null | sort | uniq -c | head -8
tar czf "$out/raw.tgz" -C "$out" raw-pipeline raw-device 2>/dev/null && rm -rf "$out"/raw-*
