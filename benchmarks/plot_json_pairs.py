"""Issue 15's bar, run by run: W-B json 100% / json 0% through kvserve's server, one dot per alternated pair.

    python benchmarks/plot_json_pairs.py docs/results/2026-12-07-s2*/**/pair.json --out docs/img/issue15_pairs.png

Each `online_pair.py` record (its `--out` JSON, with the device's name in `gpu.txt` beside it) is one row: its
pairs' ratios as dots, its ratio of medians (what the report's table and the bar read) as a bar mark, coloured
by device. The pooled median of every pair on a device is printed with the table. The bar is 0.90x.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

BAR = 0.90
LOAD = "W-B json 100%|kvserve"


@dataclass
class Run:
    """One online_pair.py record: where it came from, its device, its pairs and its ratio of medians."""
    name: str
    device: str
    pairs: list[float]
    ratio: float


def read_run(path: Path) -> Run | None:
    """The record's json 100% figures, or None if it has none (a run of other loads)."""
    figure = json.loads(path.read_text()).get("figures", {}).get(LOAD)
    if not figure or not figure.get("vs_json0_paired"):
        return None
    gpu = path.parent / "gpu.txt"
    device = gpu.read_text().split(",")[0].strip() if gpu.is_file() else "unknown"
    parts = path.parts[path.parts.index("results") + 1:] if "results" in path.parts else path.parts[-3:]
    name = "/".join(parts[:-1] + ((path.stem,) if path.stem != "pair" else ())).replace("2026-12-", "")
    return Run(name, device, figure["vs_json0_paired"], figure["vs_json0"])


def pooled(runs: list[Run]) -> dict[str, tuple[int, float]]:
    """device -> (pairs, median pair) over every run on it."""
    by_device: dict[str, list[float]] = {}
    for run in runs:
        by_device.setdefault(run.device, []).extend(run.pairs)
    return {device: (len(p), statistics.median(p)) for device, p in by_device.items()}


def table(runs: list[Run]) -> list[str]:
    lines = ["| run | device | pairs | ratio of medians | median pair (range) |", "|---|---|---:|---:|---:|"]
    for run in runs:
        lines.append(f"| {run.name} | {run.device} | {len(run.pairs)} | {run.ratio:.2f}x | "
                     f"{statistics.median(run.pairs):.2f} ({min(run.pairs):.2f}-{max(run.pairs):.2f}) |")
    for device, (count, median) in pooled(runs).items():
        lines.append(f"| pooled | {device} | {count} | | {median:.2f} |")
    return lines


def plot(runs: list[Run], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {device: f"C{i}" for i, device in enumerate(sorted({r.device for r in runs}))}
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(runs) + 1.6))
    for y, run in enumerate(runs):
        colour = colours[run.device]
        ax.scatter(run.pairs, [y] * len(run.pairs), s=14, alpha=0.5, color=colour)
        ax.scatter([run.ratio], [y], marker="|", s=300, color=colour)
    ax.axvline(BAR, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(runs)), [r.name for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel("W-B json 100% / json 0%, output tok/s")
    ax.set_title("dots: alternated pairs; bars: each run's ratio of medians; dashed: the 0.90x bar", fontsize=9)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=c, label=d) for d, c in colours.items()]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", type=Path, help="online_pair.py --out files")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args()
    runs = [run for run in map(read_run, sorted(args.records)) if run is not None]
    if not runs:
        raise SystemExit("no record with W-B json 100% pairs")
    print("\n".join(table(runs)))
    plot(runs, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
