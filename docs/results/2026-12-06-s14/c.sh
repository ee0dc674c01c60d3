#!/usr/bin/env bash
# Fourteenth session, call C (gpu-1, gpu-2 staged; carrying .carry/gpu-3 and .carry/extra): the prefill's norm over
# several rows a program (engine/kernels.py NORM_ROWS): the kernels' GPU tests, the norm alone by rows a program
# (benchmarks/norm_rows.py), then W-L end to end with NORM_ROWS 4, then 1 (WL_ROWS). Ran in the fifteenth session at e82ab26 (raw: ../2026-12-06-s15/a/): no gain, the rows kernel removed after; runs only at that commit.
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages \
#     && bash docs/results/2026-12-06-s14/c.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py > "$out/tests.log" 2>&1
tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head
timeout 90 python3 benchmarks/norm_rows.py --out "$out/norm_rows.json" 2>&1 | tee "$out/norm_rows.log" | grep "^|"
for rows in ${WL_ROWS:-4 1}; do
  n=$(ls "$out" | grep -c "^wl-")
  timeout 110 python3 docs/results/2026-12-06-s14/wl_norm_rows.py "$rows" "$out/wl-$n-rows$rows.json" \
    > "$out/wl-$n-rows$rows.log" 2>&1
  echo "W-L, NORM_ROWS=$rows:"; grep -v "Loading weights\|Writing model\|capturing" "$out/wl-$n-rows$rows.log" | tail -4
done
