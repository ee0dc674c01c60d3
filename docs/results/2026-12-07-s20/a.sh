#!/usr/bin/env bash
# Twentieth session, call A (vllm-1..3 staged; carrying .carry/vllm-4, .carry/server, .carry/extra, .carry/peers,
# .carry/vllm-extra): issue 15's pair beside vLLM's server, W-B greedy json 0/20/100%, kvserve with its default
# wait for the grammar masks (the host's, `pipeline`), xgrammar for JSON schemas; no flash-attn-4 staged (W-B runs
# Triton's attention under the hybrid anyway).
#   bash .carry/vllm-4/stage.sh >/dev/null && REPEAT=3 DEADLINE_S=420 bash docs/results/2026-12-07-s20/a.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/server/*.whl .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
pip install --target /tmp/vllm-site --no-deps -q .carry/vllm-extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
deadline="${DEADLINE_S:-420}"
timeout -s KILL $((deadline + 20)) python3 benchmarks/online_pair.py --repeat "${REPEAT:-3}" --out "$out/pair.json" \
  --raw-dir "$out/raw" --deadline-s "$deadline" > "$out/pair.log" 2>&1
grep -E "^\| (W-B|TTFT|load|prompt)|target|vLLM: (up|did)" "$out/pair.log" | cut -c1-400
grep -h "grammar masks\|structured outputs:\|Traceback\|Error" "$out"/raw/kvserve-serve*.log 2>/dev/null | cut -c25- \
  | sort | uniq -c | head -8
tar czf "$out/raw.tgz" -C "$out" raw && rm -rf "$out/raw"
