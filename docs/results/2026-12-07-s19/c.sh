#!/usr/bin/env bash
# Nineteenth session, call C (a fresh machine, nothing staged; carrying .carry/server, .carry/extra, .carry/tok).
# First kvserve alone through its server, W-B greedy json 0/20/100% with xgrammar, the device waiting for the masks
# (`device`), then the host (`pipeline`), WB_S seconds in all; then the gate's GPU tests (kernel level, then the
# engine's: tests/test_mask_gate.py, tests/test_grammar_link.py -m gpu) in what is left of LIMIT_S. The next
# step's matchers now take the tokens before the scheduler's update (engine.LLMEngine._advance_rows_of).
# Issue 15's bar: json 100% >= 0.9x json 0%.
#   LIMIT_S=440 WB_S=260 REPEAT=2 bash docs/results/2026-12-07-s19/c.sh
set -u
out="${OUT:-./gpu-out}"; start=$(date +%s); mkdir -p "$out"
left() { echo $(( ${LIMIT_S:-580} - 8 - $(date +%s) + start )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
pip install --target /tmp/site --no-deps -q .carry/server/*.whl .carry/extra/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 KVSERVE_TEST_TOKENIZER="$PWD/.carry/tok"
python3 -c "import xgrammar; print('xgrammar', xgrammar.__version__)" 2>&1 | tail -1
each=$(( ${WB_S:-300} / 2 - 10 ))
for wait in device pipeline; do
  echo "== $wait: ${each} s"
  timeout -s KILL $((each + 8)) python3 benchmarks/online_pair.py --no-vllm --repeat "${REPEAT:-3}" \
    --deadline-s "$each" --min-phase-s 35 --kvserve-args "--structured-outputs-wait $wait" --out "$out/$wait.json" \
    --raw-dir "$out/raw-$wait" > "$out/$wait.log" 2>&1
  grep -E "^\| (W-B|load)|json 100% #|json 0% #" "$out/$wait.log" | cut -c1-300
done
grep -h "grammar masks\|structured outputs:\|Traceback\|Error" "$out"/raw-*/kvserve-serve.log 2>/dev/null | cut -c25- | sort | uniq -c | head -8
tar czf "$out/raw.tgz" -C "$out" raw-device raw-pipeline 2>/dev/null && rm -rf "$out"/raw-*
clean() { grep -v "Deprecat\|Warning\|warn("; }
timeout -s KILL "$(( $(left) < 80 ? $(left) : 80 ))" python3 -u -m pytest -v -p no:cacheprovider -m gpu \
  tests/test_mask_gate.py 2>&1 | clean > "$out/gate.log"; echo "gate rc $?"
grep -E "PASS|FAIL|ERROR|passed|failed|assert" "$out/gate.log" | tail -12
timeout -s KILL "$(left)" python3 -u -m pytest -v -p no:cacheprovider -m gpu tests/test_grammar_link.py 2>&1 | clean \
  > "$out/link.log"; echo "link rc $?"
grep -E "PASS|FAIL|ERROR|passed|failed" "$out/link.log" | tail -12
