#!/usr/bin/env bash
# For the next H200 (gpu-1..3 and vllm-1..3 staged; carrying .carry/vllm-4, .carry/extra, .carry/peers and
# .carry/vllm-extra): issue 15's pair beside vLLM's server (W-B greedy, json 0/20/100%), with flash-attn-4 staged so
# the TTFT rows (issue 19) run the hybrid as shipped. Run it twice, in two calls (two processes).
#   bash .carry/vllm-4/stage.sh | tail -1 && REPEAT=3 DEADLINE_S=480 bash docs/results/2026-12-07-s21/p.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
pip install --target /tmp/vllm-site --no-deps -q .carry/vllm-extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
python3 -c "import flash_attn.cute, xgrammar, zmq, msgspec" || exit 3
deadline="${DEADLINE_S:-480}"
timeout -s KILL $((deadline + 20)) python3 benchmarks/online_pair.py --repeat "${REPEAT:-3}" --out "$out/pair.json" \
  --raw-dir "$out/raw" --deadline-s "$deadline" > "$out/pair.log" 2>&1
grep -E "^\| (W-B|TTFT|load|prompt)|target|vLLM: (up|did)" "$out/pair.log" | cut -c1-400
grep -h "grammar masks\|structured outputs:\|attention backend\|Traceback\|Error" "$out"/raw/kvserve-serve*.log \
  2>/dev/null | cut -c25- | sort | uniq -c | head -8
tar czf "$out/raw.tgz" -C "$out" raw && rm -rf "$out/raw"
