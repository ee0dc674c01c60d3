"""The vLLM-named series that routers and autoscalers scrape unchanged (llm-d's endpoint picker, vLLM's
production-stack router, KEDA / HPA through the Prometheus adapter), beside our own kvserve_* names.

Names, types, label names and buckets are those of vLLM 0.24.0 (vllm/v1/metrics/loggers.py,
PrometheusStatLogger): every series is labelled model_name (the served model name) and engine (the engine
core's index, "0" with one core).

- vllm:num_requests_running, vllm:num_requests_waiting (gauges): requests in the batch / in the engine's queue.
- vllm:kv_cache_usage_perc (gauge, 0-1): KV blocks held by live requests over all blocks; evictable
  prefix-cache blocks count as free, as in vLLM's BlockPool.get_usage.
- vllm:prefix_cache_queries, vllm:prefix_cache_hits (counters, *_total): prompt tokens looked up in / found in
  the prefix cache. (kvserve also counts a preempted request's second lookup, which vLLM leaves out.)
- vllm:num_preemptions, vllm:prompt_tokens, vllm:generation_tokens (counters, *_total): preemptions, prompt
  tokens admitted, tokens generated.
- vllm:time_to_first_token_seconds (histogram): arrival to the end of the step that made the first token.
- vllm:inter_token_latency_seconds (histogram): between one step's tokens of a completion and the next's.
- vllm:request_time_per_output_token_seconds (histogram): per finished completion, (last token - first token)
  / (tokens - 1), 0 for one token.
- vllm:e2e_request_latency_seconds (histogram): arrival to the finish, for every completion the engine
  finishes (stop, length, error, abort by the server); one the client abandons is not observed (as in vLLM).
- vllm:request_success (counter, label finished_reason): completions finished, by reason.
- vllm:time_per_output_token_seconds: vLLM's old name for the inter-token latency (deprecated in 0.11,
  removed in 0.13, absent from 0.24.0). Dashboards and routers written against older vLLM still read it, so it
  is kept as an exact copy of vllm:inter_token_latency_seconds (same buckets, same observations).
"""
from __future__ import annotations

from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM 0.24.0's buckets, so histogram_quantile over a mixed fleet compares like with like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

_GAUGES = (("vllm:num_requests_running", "Number of requests in model execution batches."),
           ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
           ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."))
_COUNTERS = (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
              "prefix_cache_queries"),
             ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
              "prefix_cache_hits"),
             ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
             ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens_total"),
             ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens_total"))


def kv_cache_usage(stats) -> float:
    return stats.num_blocks_used / stats.num_blocks_total if stats.num_blocks_total else 0.0


class VllmEngineCollector:
    """The gauges and counters, read at scrape time from each engine core's latest CoreStats (the same in every
    front-end process, so never summed across them). snapshot() -> {engine index: CoreStats}."""

    def __init__(self, snapshot: Callable[[], Mapping[int, object]], model_name: Callable[[], str]):
        self._snapshot, self._model_name = snapshot, model_name

    def collect(self):
        engines, model = self._snapshot(), self._model_name()
        gauges = [GaugeMetricFamily(name, doc, labels=LABELS) for name, doc in _GAUGES]
        counters = [CounterMetricFamily(name, doc, labels=LABELS) for name, doc, _ in _COUNTERS]
        for index, stats in sorted(engines.items()):
            labels = (model, str(index))
            values = (stats.num_running, stats.num_waiting, kv_cache_usage(stats))
            for family, value in zip(gauges, values):
                family.add_metric(labels, value)
            for family, (_, _, attr) in zip(counters, _COUNTERS):
                family.add_metric(labels, getattr(stats, attr))
        yield from gauges
        yield from counters


class VllmRequestMetrics:
    """The per-request histograms and the finish counter, observed by the front end as outputs arrive (with
    several front-end processes, prometheus_client's multiprocess mode sums them)."""

    def __init__(self, registry: CollectorRegistry):
        self.model_name = "kvserve"  # set to the served model name before the first request
        self._ttft = self._histogram("vllm:time_to_first_token_seconds",
                                     "Histogram of time to first token in seconds.", TTFT_BUCKETS, registry)
        self._itl = self._histogram("vllm:inter_token_latency_seconds",
                                    "Histogram of inter-token latency in seconds.", TPOT_BUCKETS, registry)
        self._legacy_tpot = self._histogram("vllm:time_per_output_token_seconds",
                                            "Histogram of time per output token in seconds (vLLM < 0.13 name of "
                                            "vllm:inter_token_latency_seconds).", TPOT_BUCKETS, registry)
        self._request_tpot = self._histogram("vllm:request_time_per_output_token_seconds",
                                             "Histogram of time_per_output_token_seconds per request.",
                                             TPOT_BUCKETS, registry)
        self._e2e = self._histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                                    "seconds.", E2E_BUCKETS, registry)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*LABELS, "finished_reason"], registry=registry)
        self._gap_series: dict[tuple[str, int], tuple] = {}  # (model, engine) -> the ITL histograms' children

    @staticmethod
    def _histogram(name: str, doc: str, buckets, registry: CollectorRegistry) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=registry)

    def start(self, model_name: str, engines: int = 1) -> None:
        """Names the model and makes every series present (at 0) for engines 0..engines-1 before any request,
        as vLLM does, so a scraper sees them from the first scrape."""
        self.model_name = model_name
        for index in range(engines):
            for histogram in (self._ttft, self._itl, self._legacy_tpot, self._request_tpot, self._e2e):
                histogram.labels(model_name, str(index))
            for reason in FINISH_REASONS:
                self._success.labels(model_name, str(index), reason)

    def first_token(self, seconds: float, engine: int = 0) -> None:
        self._ttft.labels(self.model_name, str(engine)).observe(seconds)

    def token_gap(self, seconds: float, engine: int = 0) -> None:
        """Per token of every stream (a hot path): the two series of an engine are looked up once, not by
        labels() each time (6.7 us a token for this and kvserve's own ITL, 1.6 us an observe)."""
        series = self._gap_series.get((self.model_name, engine))
        if series is None:
            labels = (self.model_name, str(engine))
            series = self._gap_series[(self.model_name, engine)] = (self._itl.labels(*labels),
                                                                    self._legacy_tpot.labels(*labels))
        for histogram in series:
            histogram.observe(seconds)

    def finished(self, reason: str, e2e: float, time_per_output_token: float, engine: int = 0) -> None:
        labels = (self.model_name, str(engine))
        self._success.labels(*labels, reason).inc()
        self._e2e.labels(*labels).observe(e2e)
        self._request_tpot.labels(*labels).observe(time_per_output_token)
