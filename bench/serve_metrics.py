"""The figures of a `kvserve bench serve` run, under vLLM's definitions and key names: TTFT, TPOT, ITL and
E2EL statistics, throughput and goodput, peak concurrency; the summary table and the four-panel plot.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from bench.serve_client import RequestResult

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = (("ttft", "TTFT", "Time to First Token"),
                   ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                   ("itl", "ITL", "Inter-token Latency"),
                   ("e2el", "E2EL", "End-to-end Latency"))


def token_times(r: RequestResult) -> list[float]:
    """When each chunk with a choice arrived, seconds after the benchmark started."""
    return list(r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)]))


def output_tokens_over_time(results: list[RequestResult], bucket_s: float) -> np.ndarray:
    """Output tokens per second in buckets of `bucket_s`; a chunk stands for output_tokens / chunks tokens."""
    ok = [r for r in results if r.success]
    if not ok:
        return np.zeros(0)
    end = max(r.start_time + r.latency for r in ok)
    counts = np.zeros(int(end // bucket_s) + 1)
    for r in ok:
        times = token_times(r)
        for t in times:
            counts[int(t // bucket_s)] += r.output_tokens / len(times)
    return counts / bucket_s


def peak_concurrency(results: list[RequestResult]) -> int:
    """vLLM's sweep over the successful requests' [start, end) intervals; ends sort before starts."""
    events = sorted([(r.start_time, 1) for r in results if r.success]
                    + [(r.start_time + r.latency, -1) for r in results if r.success])
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def _tpot(r: RequestResult) -> float:
    # vLLM: (E2EL - TTFT) / (output - 1); 0 for one-token outputs, which count as meeting a TPOT SLO.
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def count_good(ok: list[RequestResult], slos_ms: dict[str, float]) -> int:
    def good(r: RequestResult) -> bool:
        values = {"ttft": r.ttft, "tpot": _tpot(r), "e2el": r.latency}
        return all(values[name] <= ms / 1000 for name, ms in slos_ms.items())

    return sum(good(r) for r in ok)


def latency_stats(name: str, seconds: list[float], percentiles: list[float]) -> dict[str, float]:
    values = np.asarray(seconds or [0.0]) * 1000  # vLLM reports 0 for an empty list
    stats = {f"mean_{name}_ms": float(np.mean(values)), f"median_{name}_ms": float(np.median(values)),
             f"std_{name}_ms": float(np.std(values))}
    for p in percentiles:
        stats[f"p{int(p) if int(p) == p else p}_{name}_ms"] = float(np.percentile(values, p))
    return stats


def compute_metrics(results: list[RequestResult], duration: float, slos_ms: dict[str, float],
                    percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    per_second = output_tokens_over_time(results, 1.0)
    metrics = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": count_good(ok, slos_ms) / duration if slos_ms else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": float(per_second.max()) if per_second.size else 0.0,
        "max_concurrent_requests": peak_concurrency(results),
    }
    series = {"ttft": [r.ttft for r in ok], "tpot": [_tpot(r) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name, values in series.items():
        metrics.update(latency_stats(name, values, percentiles))
    return metrics


def print_summary(metrics: dict, args: argparse.Namespace, percentiles: list[float]) -> None:
    row = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=52, c="="))
    print(row("Successful requests:", metrics["completed"]))
    print(row("Failed requests:", metrics["failed"]))
    if args.max_concurrency is not None:
        print(row("Maximum request concurrency:", args.max_concurrency))
    if not math.isinf(args.request_rate):
        print(num("Request rate configured (RPS):", args.request_rate))
    print(num("Benchmark duration (s):", metrics["duration"]))
    print(row("Total input tokens:", metrics["total_input_tokens"]))
    print(row("Total generated tokens:", metrics["total_output_tokens"]))
    print(num("Request throughput (req/s):", metrics["request_throughput"]))
    if metrics["request_goodput"] is not None:
        print(num("Request goodput (req/s):", metrics["request_goodput"]))
    print(num("Output token throughput (tok/s):", metrics["output_throughput"]))
    print(num("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"]))
    print(row("Peak concurrent requests:", metrics["max_concurrent_requests"]))
    print(num("Total token throughput (tok/s):", metrics["total_token_throughput"]))
    for key, short, header in LATENCY_METRICS:
        print("{s:{c}^{n}}".format(s=header, n=52, c="-"))
        print(num(f"Mean {short} (ms):", metrics[f"mean_{key}_ms"]))
        print(num(f"Median {short} (ms):", metrics[f"median_{key}_ms"]))
        for p in percentiles:
            word = int(p) if int(p) == p else p
            print(num(f"P{word} {short} (ms):", metrics[f"p{word}_{key}_ms"]))
    print("=" * 52)


def _cdf(ax, values_ms: list[float], title: str) -> None:
    values = np.sort(np.asarray(values_ms, dtype=float))
    if values.size:
        ax.step(values, np.arange(1, values.size + 1) / values.size, where="post")
        ax.axvline(np.median(values), color="gray", linestyle=":", label=f"median {np.median(values):.1f} ms")
        ax.legend(loc="lower right")
    ax.set_title(f"{title} CDF (n={values.size})")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests" if title != "ITL" else "fraction of gaps")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def make_figure(results: list[RequestResult], duration: float, title: str):
    """Four panels: CDFs of TTFT, ITL, E2EL; output tokens/s over time. No pyplot: no global state."""
    from matplotlib.figure import Figure

    ok = [r for r in results if r.success]
    fig = Figure(figsize=(12, 8), layout="constrained")
    (ax_ttft, ax_itl), (ax_e2el, ax_tput) = fig.subplots(2, 2)
    _cdf(ax_ttft, [r.ttft * 1000 for r in ok], "TTFT")
    _cdf(ax_itl, [x * 1000 for r in ok for x in r.itl], "ITL")
    _cdf(ax_e2el, [r.latency * 1000 for r in ok], "E2EL")
    bucket = max(duration / 50, 0.05)  # ~50 points, whatever the run's length
    rate = output_tokens_over_time(results, bucket)
    ax_tput.plot(np.arange(rate.size) * bucket + bucket / 2, rate, marker=".")
    ax_tput.set_title(f"Output throughput over time ({bucket:.2g} s buckets)")
    ax_tput.set_xlabel("seconds since start")
    ax_tput.set_ylabel("output tokens/s")
    ax_tput.grid(alpha=0.3)
    fig.suptitle(title)
    return fig


def write_plot(path: str, results: list[RequestResult], duration: float, title: str) -> None:
    make_figure(results, duration, title).savefig(path, dpi=100)

