#!/usr/bin/env bash
# Eighteenth session, call A (gpu-1, gpu-2, vllm-1..4 staged; carrying .carry/gpu-3, .carry/extra, .carry/peers,
# .carry/vllm-extra): issue 15's pair beside vLLM's server, W-B greedy json 0/20/100%, kvserve with the device
# waiting for the grammar masks (--structured-outputs-wait WAIT, default device), REPEAT repetitions.
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && REPEAT=4 DEADLINE_S=330 bash docs/results/2026-12-07-s18/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
pip install --target /tmp/vllm-site --no-deps -q .carry/vllm-extra/*.whl 2>&1 | grep -v WARNING | tail -2
deadline="${DEADLINE_S:-330}"
timeout $((deadline + 15)) python3 benchmarks/online_pair.py --repeat "${REPEAT:-4}" --out "$out/pair.json" \
  --kvserve-args "--structured-outputs-wait ${WAIT:-device}" --raw-dir "$out/raw" --deadline-s "$deadline" \
  > "$out/pair.log" 2>&1
grep -E "^\| (W-B|TTFT|load|prompt)|target|vLLM: (up|did)" "$out/pair.log" | cut -c1-400
grep -h "grammar masks\|Traceback\|Error" "$out"/raw/kvserve-serve*.log 2>/dev/null | sort | uniq -c | head -8
tar czf "$out/raw.tgz" -C "$out" raw && rm -rf "$out/raw"
