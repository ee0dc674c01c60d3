#!/usr/bin/env bash
# For the next H200 (gpu-1..3 staged; carrying .carry/extra): issue 15's kvserve half with the grammar processes'
# threads cut, beside the defaults, alternated (~6 min). On the 2-core CPU the engine thread's sections
# (schedule, prepare, the forward's queueing) ran 1.3-2x slower whenever grammar work ran beside them (a grammar
# process, or in-process fills), as on the H100 at json 100% (docs/benchmarks.md, twenty-fifth session): if
# threads oversubscribe the host's cores at each step, fewer of them should close the gap.
#   bash docs/results/2026-12-07-s25/k2.sh          (SPIN0=1 REPEAT=3 adds the engine blocking for its masks)
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
nproc | tee "$out/nproc.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
python3 -c "import flash_attn.cute, xgrammar, zmq, msgspec" || exit 3
pair() {  # NAME KVSERVE_ARGS
  timeout -s KILL 270 python3 benchmarks/online_pair.py --no-vllm --repeat "${REPEAT:-4}" --out "$out/$1.json" \
    --raw-dir "$out/raw-$1" --deadline-s 250 --kvserve-args "$2" > "$out/$1.log" 2>&1
  grep -E "^\| (W-B|load)|target" "$out/$1.log" | cut -c1-300 | sed "s/^/$1 /"
}
pair default ""
pair lean "--structured-outputs-processes 2 --structured-outputs-fill-threads 1"
[ -n "${SPIN0:-}" ] && pair nospin "--structured-outputs-spin-ms 0"  # a third arm (REPEAT=3 to stay in 600 s)
rm -rf "$out"/raw-*
