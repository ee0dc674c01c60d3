#!/usr/bin/env bash
# Third session of 2026-12-05, first machine: both servers (`gpu_session.sh pair`), then the mask engines' fill
# times on the host (what found llguidance's 28.8 ms a step). Staging: gpu-1, gpu-2, vllm-1..4, one call each.
bash .carry/gpu-3/stage.sh && PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages bash benchmarks/gpu_session.sh pair
# next call (xgrammar from vLLM's site, llguidance 1.6.1 from .carry/extra):
pip install --target /tmp/site --no-deps -q .carry/extra/*.whl
PYTHONPATH=.:/tmp/site:/tmp/vllm-site python3 benchmarks/grammar_engines.py --batch 256 --tokenizer wb-bpe
