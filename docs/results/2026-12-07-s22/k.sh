#!/usr/bin/env bash
# For the next H200 (gpu-1..3 staged; carrying .carry/extra): issue 15's first half of the bar, kvserve alone,
# W-B greedy at json 0/20/100%, ten alternated repetitions each (the twenty-second session's two runs of three
# gave 0.86x and 0.90x, each repetition's load lasting ~1 s, ratios ranging 0.59-1.14) (~3 min).
#   bash docs/results/2026-12-07-s22/k.sh      (KVSERVE_ARGS: more `kvserve serve` flags, added 2026-12-08)
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
python3 -c "import flash_attn.cute, xgrammar, zmq, msgspec" || exit 3
timeout -s KILL 400 python3 benchmarks/online_pair.py --no-vllm --repeat "${REPEAT:-10}" --out "$out/pair.json" \
  --raw-dir "$out/raw" --deadline-s 360 --kvserve-args "${KVSERVE_ARGS:-}" > "$out/pair.log" 2>&1
grep -E "^\| (W-B|TTFT|load|prompt)|target" "$out/pair.log" | cut -c1-400
tar czf "$out/raw.tgz" -C "$out" raw && rm -rf "$out/raw"
