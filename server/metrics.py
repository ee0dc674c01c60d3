"""Prometheus metrics, in a registry per app (two servers in one process never share counters).

Engine-side numbers (queue lengths, KV blocks, prefix cache, token counters) are read at scrape time from
the latest CoreStats each engine core sent (every step, and every 0.25 s while idle), summed over the cores
and per core; latencies and finishes are observed by the front end as outputs arrive. Beside them, the
vLLM-named series routers and autoscalers read (server/metrics_vllm.py), from the same numbers.
"""
from __future__ import annotations

from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.grammar_messages import WORKER_TIMES
from engine.step_clock import DEVICE_PARTS, SECTIONS
from server.metrics_vllm import VllmEngineCollector, VllmRequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                    300.0, 600.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


_GAUGES = (("requests_running", "completions running in the batch", "num_running"),
           ("requests_waiting", "completions waiting in the engine's queue", "num_waiting"),
           ("kv_blocks_total", "KV-cache blocks in the pool", "num_blocks_total"),
           ("kv_blocks_used", "KV-cache blocks held by live requests (not evictable cache)", "num_blocks_used"),
           ("kv_blocks_cached", "evictable prefix-cache blocks", "num_blocks_cached"))
_COUNTERS = (("prefix_cache_queries", "prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
             ("prefix_cache_hits", "prompt tokens found in the prefix cache", "prefix_cache_hits"),
             ("preemptions", "requests preempted for lack of KV blocks", "num_preemptions"),
             ("prompt_tokens", "prompt tokens admitted", "prompt_tokens_total"),
             ("generation_tokens", "tokens generated", "generation_tokens_total"),
             ("engine_steps", "engine steps run", "num_steps"),
             ("idle_invariant_violations", "times the engine went idle with KV blocks still held by no request",
              "idle_invariant_violations"),
             ("grammar_process_restarts", "grammar processes started again after one died (their constrained "
              "requests failed)", "grammar_process_restarts"),
             ("structured_steps", "engine steps sampled under grammar masks", "structured_steps"),
             ("structured_mask_wait_seconds", "the engine's wait for grammar masks before sampling, summed over "
              "those steps", "structured_mask_wait_seconds"),
             ("engine_busy_seconds", "time the engine spent in its steps (idle waits excluded)", "busy_seconds"))


class _EngineStatsCollector:
    """Gauges and cumulative counters straight from the engine cores' latest CoreStats, twice: summed over
    the cores under the plain names (`kvserve_kv_blocks_used`: what one core reported before data parallel,
    so single-core dashboards read the same series), and per core as `kvserve_core_*{engine="i"}` (the label
    the vllm:* series use), whose sum over `engine` is the plain series. Separate names, so a PromQL sum()
    over either never counts a core twice."""

    def __init__(self, per_engine: Callable[[], Mapping[int, object]]):
        self._per_engine = per_engine

    def collect(self):
        engines = sorted(self._per_engine().items())  # one read: the sums are of the very numbers shown per core
        for kind, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, doc, attr in table:
                total = sum(getattr(stats, attr) for _, stats in engines)
                yield kind(f"kvserve_{name}", f"{doc} (all engine cores)", value=total)
                per_core = kind(f"kvserve_core_{name}", f"{doc}, per engine core", labels=("engine",))
                for index, stats in engines:
                    per_core.add_metric((str(index),), getattr(stats, attr))
                yield per_core
        yield _by_label(engines, "section_seconds", SECTIONS, "kvserve_engine_section_seconds", "section",
                        "time the engine thread spent in each section of its steps, and in the core loop between "
                        "them (engine/step_clock.py; all engine cores)")
        yield _by_label(engines, "device_seconds", DEVICE_PARTS, "kvserve_engine_device_seconds", "part",
                        "the device's time on the engine's steps by part, idle gaps included (engine/device_clock.py; "
                        "CUDA only; all engine cores)")
        yield _by_label(engines, "grammar_worker_seconds", WORKER_TIMES, "kvserve_grammar_worker_seconds", "part",
                        "the grammar processes' time on constrained steps by part, the slowest process's per step "
                        "(engine/grammar_messages.py WORKER_TIMES; all engine cores)")


def _by_label(engines: list, attr: str, names: tuple[str, ...], family_name: str, label: str,
              doc: str) -> CounterMetricFamily:
    """A CoreStats list field (`names` in order) as one counter per name, summed over the cores."""
    family = CounterMetricFamily(family_name, doc, labels=(label,))
    for i, name in enumerate(names):
        family.add_metric((name,), sum(getattr(s, attr)[i] for _, s in engines if len(getattr(s, attr)) > i))
    return family


class ServerMetrics:
    """multiprocess_dir: with several front-end processes, prometheus_client's multiprocess mode (its
    PROMETHEUS_MULTIPROC_DIR, set before any process imports prometheus_client) sums their counters and
    histograms; the engine's own numbers come from the core, the same in every front end."""

    def __init__(self, snapshot: Callable[[], object], multiprocess_dir: str | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.vllm = VllmRequestMetrics(self.registry)
        self._per_engine: Callable[[], Mapping[int, object]] = lambda: {0: snapshot()}
        self._engine = (_EngineStatsCollector(lambda: self._per_engine()),
                        VllmEngineCollector(lambda: self._per_engine(), lambda: self.vllm.model_name))
        self._render_registry = self._rendering(multiprocess_dir)
        r = self.registry
        self.finished = Counter("kvserve_requests_finished", "completions finished, by reason", ["reason"],
                                registry=r)
        self.rejected = Counter("kvserve_requests_rejected", "requests refused before admission, by error code",
                                ["code"], registry=r)
        self.timeouts = Counter("kvserve_request_timeouts", "requests ended by a deadline, by which one",
                                ["deadline"], registry=r)
        self.ttft = Histogram("kvserve_time_to_first_token_seconds", "arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvserve_inter_token_latency_seconds", "time between tokens of one completion",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds", "arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvserve_queue_time_seconds",
                                    "arrival to the start of the step that gave the first token (the queue wait)",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(reason)  # present at 0 from the start

    def name_engines(self, model_name: str, per_engine: Callable[[], Mapping[int, object]] | None = None) -> None:
        """Labels of the per-core series (vllm:*, kvserve_core_*): model_name, and engine="i" per engine core,
        whose CoreStats per_engine() returns as {i: CoreStats} (default: the one snapshot as engine 0). Before
        any request."""
        if per_engine is not None:
            self._per_engine = per_engine
        self.vllm.start(model_name, engines=len(self._per_engine()))

    def _rendering(self, multiprocess_dir: str | None) -> CollectorRegistry:
        if multiprocess_dir is None:
            for collector in self._engine:
                self.registry.register(collector)
            return self.registry
        from prometheus_client import multiprocess

        registry = CollectorRegistry(auto_describe=False)
        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
        for collector in self._engine:
            registry.register(collector)
        return registry

    def render(self) -> bytes:
        return generate_latest(self._render_registry)
