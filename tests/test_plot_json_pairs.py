"""benchmarks/plot_json_pairs.py: issue 15's pairs, run by run and pooled by device, from online_pair.py records."""
from __future__ import annotations

import json
from pathlib import Path

from server_utils import benchmark_module

plot_json_pairs = benchmark_module("plot_json_pairs")


def record(folder: Path, device: str | None, pairs: list[float], ratio: float) -> Path:
    folder.mkdir(parents=True)
    figures = {"W-B json 100%|kvserve": {"vs_json0": ratio, "vs_json0_paired": pairs}} if pairs else {}
    (folder / "pair.json").write_text(json.dumps({"figures": figures}))
    if device:
        (folder / "gpu.txt").write_text(f"{device}, 580.159.04\n")
    return folder / "pair.json"


def test_runs_are_read_pooled_by_device_and_plotted(tmp_path):
    results = tmp_path / "docs" / "results"
    paths = [record(results / "s1" / "k", "NVIDIA H100 80GB HBM3", [0.8, 0.9, 1.0], 0.85),
             record(results / "s2" / "k", "NVIDIA H100 80GB HBM3", [0.6, 0.7], 0.65),
             record(results / "s3" / "p", "NVIDIA H200", [0.95], 0.95),
             record(results / "s4" / "x", None, [], 0.0)]  # no json 100% figures: skipped
    runs = [r for r in map(plot_json_pairs.read_run, paths) if r is not None]
    assert [(r.name, r.device) for r in runs] == [("s1/k", "NVIDIA H100 80GB HBM3"), ("s2/k", "NVIDIA H100 80GB HBM3"),
                                                  ("s3/p", "NVIDIA H200")]
    assert plot_json_pairs.pooled(runs) == {"NVIDIA H100 80GB HBM3": (5, 0.8), "NVIDIA H200": (1, 0.95)}
    lines = plot_json_pairs.table(runs)
    assert "| s1/k | NVIDIA H100 80GB HBM3 | 3 | 0.85x | 0.90 (0.80-1.00) |" in lines
    out = tmp_path / "pairs.png"
    plot_json_pairs.plot(runs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
