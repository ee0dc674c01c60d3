#!/usr/bin/env bash
# Fourth session of 2026-12-05: the pipelined constrained step (engine/engine.py _step_behind_masks, the mask
# thread's 0.2 ms GIL switch interval) on the device: xgrammar's bitmask kernel against its reference, the
# offline engine's json 0%/100% per-step sections (benchmarks/structured_step.py), then issue 15's structured
# W-B through kvserve's server alone (vLLM's server ran beside the same load on the same machine in a/; the
# device budget left could not hold it again). From the repository root, after staging gpu-1 and gpu-2,
# carrying .carry/gpu-3 and .carry/extra:
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-h100-s4/c.sh
set -u
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
out=${OUT:-/tmp/out}
mkdir -p "$out"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k xgrammar 2>&1 | tail -3
timeout 100 python3 benchmarks/structured_step.py --runs 1 --out "$out/structured_step.json" 2>&1 \
  | grep -v "Loading\|Writing\|capturing" | tail -24
python3 -c "import xgrammar" 2>/dev/null && echo "xgrammar: JSON masks" || echo "no xgrammar: llguidance masks"
timeout 330 python3 benchmarks/online_pair.py --no-vllm --repeat 2 --out "$out/pair.json" --raw-dir "$out/pair-raw" \
  --deadline-s 310 > "$out/pair.log" 2>&1
grep -v "Loading weights\|Writing model\|capturing" "$out/pair.log" | tail -30
