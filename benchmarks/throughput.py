"""Offline throughput of kvserve (and transformers, with --compare-hf) on the standard workloads.

    python benchmarks/throughput.py --preset cpu-smollm2 --compare-hf
    python benchmarks/throughput.py --preset wb --attention-backend triton,flash-attn --compare-hf generate,generate_batch --repeat 3 --out wb.json

A thin wrapper over `kvserve bench throughput` (bench/throughput.py): the options are the same.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.throughput import build_parser, main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
