#!/usr/bin/env bash
# Fifth session of 2026-12-05, call 2: issue 15's structured W-B at 0/20/100% through kvserve's server and
# vLLM 0.24.0's (`gpu_session.sh pair`), kvserve with the step loop that a.sh measured faster at json 100%
# (pipelined unless serial beat it with no failed request; a.sh not run on this machine: pipelined).
# After staging gpu-1, gpu-2, vllm-1..4 (and a.sh), carrying .carry/gpu-3, .carry/extra, .carry/peers:
#   bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash docs/results/2026-12-05-s5/b.sh
set -u
if [ -d .carry/extra/vllm ]; then
  mkdir -p .carry/vllm-extra && cp .carry/extra/vllm/*.whl .carry/vllm-extra/
fi
loop=$(python3 - <<'PY'
import json, statistics
try:
    rows = json.load(open("/tmp/kvserve-variants.json"))["variants"]
except OSError:
    rows = {}
def best(loop):
    runs = [r for name, r in rows.items() if name.startswith(f"json 100% {loop}-0.2ms")]
    ok = [r["out_tok_s"] for r in runs if "error" not in r["finish_reasons"]]
    return statistics.median(ok) if ok and len(ok) == len(runs) else 0.0
print("serial" if best("serial") > best("pipelined") else "pipelined")
PY
)
echo "kvserve's constrained step loop: $loop"
[ "$loop" = serial ] && export KVSERVE_STRUCTURED_OUTPUTS_PIPELINE=false
bash benchmarks/gpu_session.sh pair --deadline-s 420
