"""W-L through `kvserve bench throughput` with engine/kernels.py NORM_ROWS set first (rows a program of the
prefill's norm): python3 docs/results/2026-12-06-s14/wl_norm_rows.py ROWS OUT_JSON
Runs only at e82ab26 or before: the rows kernel was removed in the fifteenth session (no gain)."""
import sys

sys.path.insert(0, ".")
import engine.kernels as kernels  # noqa: E402
from bench.throughput import build_parser, main  # noqa: E402

kernels.NORM_ROWS = int(sys.argv[1])
sys.exit(main(build_parser().parse_args(["--preset", "wl", "--skip-tokenizer-init", "--repeat", "3",
                                         "--out", sys.argv[2]])))
