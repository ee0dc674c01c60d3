"""The W-C report (bench/online_report.py): medians over repetitions, kvserve's ratios, the server / offline
ratio and issue 14's targets, from the runs' figures alone (the servers are benchmarks/online_wc.py's job)."""
from __future__ import annotations

import math

from bench.online_report import Load, Run, slowest_ttfts, table, targets

LOADS = [Load("256 at once", 256, math.inf, None, 4, 2), Load("1024 at once", 1024, math.inf, None, 4, 2),
         Load("40 req/s", 160, 40.0, None, 2, 1), Load("one at a time", 12, math.inf, 1, 1, 1)]


def figures(tput: float, ttft50: float, ttft99: float, tpot: float, failed: int = 0) -> dict:
    return {"output_throughput": tput, "median_ttft_ms": ttft50, "p99_ttft_ms": ttft99, "median_tpot_ms": tpot,
            "failed": failed}


def runs_of(system: str, scale: float, latency: float) -> list[Run]:
    runs = []
    for load in LOADS:
        for rep in range(load.repeats):
            runs.append(Run(system, load.name, rep, figures(scale * (1000 + 100 * rep), latency * (10 + rep),
                                                           latency * 30, latency)))
    return runs


def test_medians_ratios_and_targets():
    runs = runs_of("kvserve", 40, 1.0) + runs_of("vLLM", 10, 2.0) + runs_of("vLLM x4", 30, 1.5)
    runs.append(Run("vLLM", "256 at once", 2, figures(10**9, 1, 1, 1, failed=3)))  # failures: not counted
    runs.append(Run("vLLM x4", "40 req/s", 0, error="skipped: the deadline is near"))
    text, figs = table(runs, ["kvserve", "vLLM", "vLLM x4"], LOADS, {"output_tokens_per_second": 60000.0,
                                                                      "name": "kvserve (triton)"})
    assert figs["256 at once|output_throughput"] == {"kvserve": 42000, "vLLM": 10500, "vLLM x4": 31500}
    assert figs["256 at once|median_ttft_ms"]["vLLM"] == 21.0  # median of 20 and 22
    assert "4.00x" in text and "1.33x" in text  # 42000 / 10500, 42000 / 31500
    assert "server / offline: 256 at once 0.70x, 1024 at once 0.70x" in text
    checks = targets(figs, ["kvserve", "vLLM", "vLLM x4"], {"output_tokens_per_second": 60000.0})
    assert "PASS  256 at once: kvserve >= 70% of offline W-B" in checks
    assert "PASS  1024 at once: kvserve >= 2.0x vLLM" in checks
    assert "FAIL  256 at once: kvserve >= 1.5x vLLM x4" in checks  # 1.33x
    assert "PASS  one at a time: TTFT p50 and TPOT p50 <= vLLM's" in checks
    alone = targets(figs, ["kvserve"], None)
    assert alone == ["n/a   256 at once: kvserve >= 70% of offline W-B", "n/a   1024 at once: kvserve >= 70% of "
                     "offline W-B"]


def test_slowest_ttfts_say_when_their_requests_were_sent():
    """The longest TTFTs first, each with its send time after the run's first request; failed requests
    (TTFT 0 or None) are left out."""
    result = {"ttfts": [0.010, 0.700, None, 0.012, 0.0, 0.300],
              "start_times": [100.0, 100.05, 100.1, 100.2, 100.3, 102.5]}
    assert slowest_ttfts(result, k=2) == [{"ttft_ms": 700.0, "sent_at_s": 0.05},
                                                        {"ttft_ms": 300.0, "sent_at_s": 2.5}]
    assert slowest_ttfts({"ttfts": [None], "start_times": [1.0]}) == []
