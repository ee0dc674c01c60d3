#!/usr/bin/env bash
# The wheels the H200 host lacks beyond shared/gpu's and shared/peers/vllm's (run here, where pip reaches PyPI):
#   .carry/extra       kvserve's server and tests: install there with
#                      pip install --target /tmp/site --no-deps .carry/extra/*.whl
#                      and py-spy (online_pair.py --py-spy) with a target of its own (an existing bin/ is skipped):
#                      pip install --target /tmp/pyspy --no-deps .carry/extra/py_spy-*.whl; PATH=/tmp/pyspy/bin:$PATH
#   .carry/vllm-extra  vLLM 0.24.0's structured outputs (without lm-format-enforcer every constrained request is
#                      a 500 with an empty message: docs/benchmarking.md); install there with
#                      pip install --target /tmp/vllm-site --no-deps .carry/vllm-extra/*.whl
# Both fit in one call's carry with .carry/gpu-3 (~40 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
dl() {
    local tags=()  # pip matches only the tags it is given: every glibc up to the host's 2.28
    for t in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 \
             manylinux1; do tags+=(--platform "${t}_x86_64"); done
    python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 "${tags[@]}" --platform any \
        -d "$1" "${@:2}"
}
dl .carry/extra pyzmq msgspec setproctitle httptools fastapi-offline "llguidance>=1.0" pytest-timeout "xgrammar>=0.2.9" py-spy \
    jsonschema jsonschema-specifications referencing rpds-py attrs  # the last line: tests that validate JSON outputs
dl .carry/vllm-extra lm-format-enforcer==0.11.3 interegular outlines_core==0.2.14 diskcache==5.6.3 lark==1.2.2
ls .carry/extra .carry/vllm-extra
