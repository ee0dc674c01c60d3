#!/usr/bin/env bash
# Eleventh session, call D (gpu-1, gpu-2 staged; carrying .carry/gpu-3, .carry/extra and .ab-base, a worktree of
# the commit before the change under test): the pair without vLLM, 4 repetitions, for this checkout's kvserve
# and the worktree's, one after the other on one machine (s11/a.sh on each).
#   git worktree add .ab-base BASE_COMMIT   # (.ab-base/ in .git/info/exclude)
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s11/ab.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
here=$(pwd)
export DEADLINE_S="${DEADLINE_S:-145}"  # each server's share of the call
OUT="$out" bash docs/results/2026-12-06-s11/a.sh "new=" 2>&1 | grep -v "^| W-B"
cp -r .carry .ab-base/ 2>/dev/null
(cd .ab-base && OUT="$out" PYTHONPATH=".:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages" bash "$here/docs/results/2026-12-06-s11/a.sh" "base=" 2>&1 | grep -v "^| W-B")
