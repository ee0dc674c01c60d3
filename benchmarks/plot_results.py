"""Plot one H200 session's results (docs/results/<date>-h200/) into docs/img/.

    python benchmarks/plot_results.py docs/results/2026-12-02-h200 --out docs/img/h200_2026-12-02.png

Left: output tokens/s per system on W-A and W-B (kvserve per backend, vLLM, transformers), medians.
Right: one decode step (batch 256) as the profiles saw it: host busy time, device kernel time and the
memory roofline, before and after the step-loop changes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def kvserve_rates(path: Path) -> dict[str, float]:
    """backend -> output tok/s (median) from a `kvserve bench throughput --out` file."""
    results = json.loads(path.read_text())["results"]
    return {r["name"].split("(")[1].split(",")[0]: r["output_tokens_per_second"]
            for r in results if r["name"].startswith("kvserve")}


def hf_rates(path: Path) -> dict[str, float]:
    results = json.loads(path.read_text())["results"]
    return {r["name"].split(" (")[0].removeprefix("transformers "): r["output_tokens_per_second"]
            for r in results if r["name"].startswith("transformers")}


def vllm_rates(path: Path) -> dict[str, float]:
    """workload letter -> median output tok/s of vllm_bench.py's RESULT lines."""
    runs: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "workload" in record:
            runs.setdefault(record["workload"][:3], []).append(record["output_tok_per_s"])
    return {k: statistics.median(v) for k, v in runs.items()}


def plot(results: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vllm = vllm_rates(results / "vllm.jsonl")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    colors: dict[str, str] = {}  # one colour per system across both workloads
    for i, (workload, key) in enumerate((("wa", "W-A"), ("wb", "W-B"))):
        rates = {f"kvserve {b}": v for b, v in sorted(kvserve_rates(results / f"kvserve-{workload}.json").items())}
        rates["vLLM 0.24.0"] = vllm[key]
        if workload == "wb":
            rates.update({f"transformers {m}": v for m, v in hf_rates(results / "hf-wb.json").items()})
        width = 0.8 / len(rates)
        for j, (name, value) in enumerate(rates.items()):
            new = name not in colors
            colors.setdefault(name, f"C{len(colors)}")
            bar = ax.bar(i + (j - (len(rates) - 1) / 2) * width, value / 1e3, width, label=name if new else None,
                         color=colors[name])
            ax.bar_label(bar, [f"{value / 1e3:.1f}k"], fontsize=7)
    ax.set_xticks([0, 1], ["W-A (nano-vllm, T=0.6)", "W-B (512 in, 128 out, greedy)"])
    ax.set_ylabel("output tokens/s (thousands), median of 3")
    ax.set_title("Qwen2.5-0.5B shape, bf16, one H200, one session")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left", ncol=3)

    steps = {"before": json.loads((results / "profile-decode-step-before.json").read_text())["results"][0],
             "after": json.loads((results / "profile-decode-step.json").read_text())["results"][0]}
    labels = [f"{k}\n({v['backend']})" for k, v in steps.items()]
    host = [v["host_busy_ms"] for v in steps.values()]
    device = [v["kernels"]["device_us_per_step"] / 1e3 for v in steps.values()]
    wall = [v["step_ms"] for v in steps.values()]
    x = range(len(steps))
    ax2.bar([i - 0.25 for i in x], host, 0.25, label="host busy (schedule + launch + postprocess)", color="C1")
    ax2.bar(list(x), device, 0.25, label="device kernels", color="C0")
    ax2.bar([i + 0.25 for i in x], wall, 0.25, label="step (wall)", color="C7")
    ax2.axhline(steps["after"]["roofline_ms"], color="k", ls="--", lw=1, label="roofline (weights + K/V at 4.3 TB/s)")
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("ms per decode step")
    ax2.set_title("one decode step, batch 256, ~571 tokens of context")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    plot(args.results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
