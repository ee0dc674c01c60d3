"""Read a `--step-trace` file: the loads in it (cut apart by idle gaps), each load's steps and their rows.

    python benchmarks/step_trace_report.py TRACE.csv [--gap-s 0.3] [--min-rows N] [--json OUT.json] [--plot OUT.png]

A load is a run of steps with no gap longer than --gap-s between two launches (online_pair.py's loads are
seconds apart: the clients start in between). Per load it prints steps, generated tokens a step, the time from
first to last step, the steps that carried prefill rows, and how many steps ran with at most half the most
rows the load ever had in one step ("thin" steps: the batch split in two would show as half the steps thin).
--min-rows N leaves out loads that never had N rows in one step (bench serve's one-request warm-ups). --plot
draws rows per step against time, one panel per load (the first 12 loads reported).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.step_trace import read_trace  # noqa: E402


def split_loads(lines: list[dict], gap_s: float) -> list[list[dict]]:
    """Runs of steps with no launch-to-launch gap longer than gap_s."""
    loads: list[list[dict]] = []
    for line in lines:
        if not loads or line["t_s"] - loads[-1][-1]["t_s"] > gap_s:
            loads.append([])
        loads[-1].append(line)
    return loads


def summarize(load: list[dict]) -> dict:
    """One load's figures (see the module's docstring)."""
    most = max(line["rows"] for line in load)
    decode = [line for line in load if line["prefill_rows"] == 0]
    return {"steps": len(load), "span_s": round(load[-1]["t_s"] - load[0]["t_s"], 4),
            "tokens_per_step": round(statistics.mean(line["sampling_rows"] for line in load), 1),
            "prefill_steps": len(load) - len(decode), "max_rows": int(most),
            "thin_steps": sum(line["rows"] <= most / 2 for line in load),
            "decode_ms_per_step": round(1e3 * _mean_interval(decode), 3),
            "max_waiting": int(max(line["waiting"] for line in load))}


def _mean_interval(lines: list[dict]) -> float:
    """Mean launch-to-launch time between consecutive lines (0 with fewer than two)."""
    gaps = [b["t_s"] - a["t_s"] for a, b in zip(lines, lines[1:])]
    return statistics.mean(gaps) if gaps else 0.0


def table(summaries: list[dict]) -> list[str]:
    keys = list(summaries[0]) if summaries else []
    rows = ["| load | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
    rows += [f"| {i} | " + " | ".join(str(s[k]) for k in keys) + " |" for i, s in enumerate(summaries)]
    return rows


def plot(loads: list[list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = loads[:12]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 1.6 * len(shown)), sharex=True, squeeze=False)
    for ax, load in zip(axes[:, 0], shown):
        t0 = load[0]["t_s"]
        ax.step([line["t_s"] - t0 for line in load], [line["rows"] for line in load], where="post", lw=0.8)
        ax.set_ylabel(f"{len(load)} steps", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the load's first step (rows a step)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--gap-s", type=float, default=0.3)
    p.add_argument("--min-rows", type=int, default=1, help="leave out loads that never had this many rows a step")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    loads = [load for load in split_loads(read_trace(args.trace), args.gap_s)
             if max(line["rows"] for line in load) >= args.min_rows]
    summaries = [summarize(load) for load in loads]
    print("\n".join(table(summaries)))
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    if args.plot and loads:
        plot(loads, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
