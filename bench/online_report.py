"""The report of the online benchmark W-C (benchmarks/online_wc.py): medians over repetitions per system and
load, kvserve's ratios to each other system, its server / offline ratio, and issue 14's targets checked on
them. Pure functions of the runs' summary figures (bench serve's keys), so they are tested without servers.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class Load:
    name: str
    num_prompts: int
    request_rate: float  # inf: all at once
    max_concurrency: int | None
    workers: int
    repeats: int


@dataclass
class Run:
    system: str
    load: str
    repeat: int
    metrics: dict = field(default_factory=dict)  # bench serve's summary keys
    error: str = ""


def slowest_ttfts(result: dict, k: int = 3) -> list[dict]:
    """The k longest TTFTs of one bench serve run, each with when its request was sent (seconds after the
    run's first): the online issue's open question is whether a rate load's TTFT p99 comes from its first
    requests (a cold path, right after the loads at once) or from any time (a stall)."""
    sent = [(t, s) for t, s in zip(result["ttfts"], result["start_times"]) if t and t > 0]
    if not sent:
        return []
    first = min(s for _, s in sent)
    return [{"ttft_ms": round(1000 * t, 1), "sent_at_s": round(s - first, 3)}
            for t, s in sorted(sent, reverse=True)[:k]]


def median_of(runs: list[Run], system: str, load: str, key: str) -> float | None:
    """The median over the repetitions in which every request completed (a run with failures counts for
    nothing: its log line says how many failed); None without one."""
    values = [r.metrics[key] for r in runs if r.system == system and r.load == load and r.metrics
              and not r.metrics["failed"]]
    return statistics.median(values) if values else None


def table(runs: list[Run], systems: list[str], loads: list[Load], offline: dict | None) -> tuple[str, dict]:
    """The printed table (median over repetitions; ratios kvserve / each other system) and its figures."""
    metrics = (("output_throughput", "out tok/s", "{:,.0f}"), ("median_ttft_ms", "TTFT p50 ms", "{:.1f}"),
               ("p99_ttft_ms", "TTFT p99 ms", "{:.1f}"), ("median_tpot_ms", "TPOT p50 ms", "{:.2f}"))
    others = systems[1:]  # ratios kvserve / other: above 1 is better for throughput, below 1 for latencies
    head = f"{'load':<14} {'':<12}" + "".join(f"{s:>16}" for s in systems) + "".join(
        f"{'kvserve/' + s[:8]:>18}" for s in others)
    lines, figures = [head, "-" * len(head)], {}
    for load in loads:
        for key, label, fmt in metrics:
            vals = {s: median_of(runs, s, load.name, key) for s in systems}
            figures[f"{load.name}|{key}"] = vals
            row = f"{load.name if key == 'output_throughput' else '':<14} {label:<12}"
            row += "".join(f"{fmt.format(v) if v is not None else '-':>16}" for v in vals.values())
            row += "".join(f"{_ratio(vals[systems[0]], vals[s]):>18}" for s in others)
            lines.append(row)
    if offline:
        rate = offline["output_tokens_per_second"]
        lines.append(f"kvserve offline ({offline['name']}): {rate:,.0f} out tok/s; server / offline: " + ", ".join(
            f"{ld.name} {_ratio(figures[f'{ld.name}|output_throughput'][systems[0]], rate)}" for ld in loads
            if math.isinf(ld.request_rate) and ld.max_concurrency is None))
    return "\n".join(lines), figures


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def targets(figures: dict, systems: list[str], offline: dict | None) -> list[str]:
    """issue 14's "done when", checked on this run's medians."""
    kv, checks = systems[0], []

    def check(what: str, ok: bool | None) -> None:
        checks.append(f"{'PASS' if ok else 'FAIL' if ok is not None else 'n/a '}  {what}")

    def fig(load: str, key: str, system: str):
        return figures.get(f"{load}|{key}", {}).get(system)

    def cmp(a, b, factor=1.0, lower=False):
        return None if a is None or b is None else (a <= b * factor if lower else a >= b * factor)

    for load in ("256 at once", "1024 at once"):
        tput = fig(load, "output_throughput", kv)
        base = offline["output_tokens_per_second"] if offline else None
        check(f"{load}: kvserve >= 70% of offline W-B", cmp(tput, base, 0.7))
        for other, factor in (("vLLM", 2.0), ("vLLM x4", 1.5)):
            if other in systems:
                check(f"{load}: kvserve >= {factor}x {other}", cmp(tput, fig(load, "output_throughput", other),
                                                                   factor))
                check(f"{load}: TTFT p99 and TPOT p50 <= {other}'s", _both(
                    cmp(fig(load, "p99_ttft_ms", kv), fig(load, "p99_ttft_ms", other), lower=True),
                    cmp(fig(load, "median_tpot_ms", kv), fig(load, "median_tpot_ms", other), lower=True)))
    for load in ("40 req/s", "one at a time"):
        if "vLLM" in systems:
            check(f"{load}: TTFT p50 and TPOT p50 <= vLLM's", _both(
                cmp(fig(load, "median_ttft_ms", kv), fig(load, "median_ttft_ms", "vLLM"), lower=True),
                cmp(fig(load, "median_tpot_ms", kv), fig(load, "median_tpot_ms", "vLLM"), lower=True)))
    return checks


def _both(a: bool | None, b: bool | None) -> bool | None:
    return None if a is None or b is None else a and b
