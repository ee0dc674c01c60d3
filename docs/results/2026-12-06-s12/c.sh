#!/usr/bin/env bash
# Twelfth session, call C (gpu-1, gpu-2 staged; carrying .carry/gpu-3, .carry/extra and .ab-base, a worktree of
# the commit before the change under test): the pair without vLLM (W-B greedy), REPEAT repetitions, this
# checkout's kvserve then the worktree's, then this checkout's again (s12/a.sh on each).
#   git worktree add .ab-base BASE_COMMIT   # (.ab-base/ in .git/info/exclude)
#   bash .carry/gpu-3/stage.sh >/dev/null && export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash docs/results/2026-12-06-s12/c.sh
set -u
out="${OUT:-./gpu-out}"; mkdir -p "$out"
here=$(pwd)
export DEADLINE_S="${DEADLINE_S:-120}" REPEAT="${REPEAT:-5}"
NAME=new OUT="$out" bash docs/results/2026-12-06-s12/a.sh 2>&1 | grep -v "^### py-spy\|samples$\|py-spy\|^NVIDIA\|^CPU\|^Model\|^Thread"
cp -r .carry .ab-base/ 2>/dev/null
(cd .ab-base && NAME=base OUT="$out" PYTHONPATH=".:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages" \
  bash "$here/docs/results/2026-12-06-s12/a.sh" 2>&1 | grep -v "^### py-spy\|samples$\|py-spy\|^NVIDIA\|^CPU\|^Model\|^Thread")
NAME=new2 OUT="$out" bash docs/results/2026-12-06-s12/a.sh 2>&1 | grep -v "^### py-spy\|samples$\|py-spy\|^NVIDIA\|^CPU\|^Model\|^Thread"
cd "$out" && tar czf raw.tgz raw-* && rm -rf raw-*
