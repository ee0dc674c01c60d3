"""/metrics exposes the vLLM-named series routers and autoscalers read (vLLM 0.24.0's names, types, label
names and buckets, checked against vllm/v1/metrics/loggers.py), and they move with the work on a real server
(front end + engine-core process); one series per engine core. Summed over `--api-server-count 2` front ends
with per-core series under `--data-parallel-size 2`: tests/test_data_parallel_front_ends.py.
"""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.messages import CoreStats
from server.metrics_vllm import VllmEngineCollector, VllmRequestMetrics
from server_utils import FaultyEngine, Faults, ServerThread, parse_metrics, start

# (name as vLLM 0.24.0 declares it, the type the text format reports)
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",  # vLLM < 0.13's name of the inter-token latency
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}
MODEL = "tiny-llama"
L = f'engine="0",model_name="{MODEL}"'  # the label set every series carries (sorted, as parse_metrics writes it)
SUCCESS_LENGTH = f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}}'


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def scrape_until(server: ServerThread, want: dict[str, float], timeout: float = 30.0) -> dict[str, float]:
    """Scrapes /metrics until every series in `want` has its value; returns that scrape."""
    end = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if all(m[k] == v for k, v in want.items()):
            return m
        assert time.monotonic() < end, f"timed out waiting for {want}: last {[m[k] for k in want]}"
        time.sleep(0.02)


def test_names_types_and_labels_are_vllms(model_dir):
    with ServerThread(model_dir, served_model_name=MODEL) as server:
        text = httpx.get(server.url("/metrics"), timeout=10).text
    found = families(text)
    for name, kind in VLLM_SERIES.items():
        assert name in found and found[name].type == kind, name
        label_sets = {tuple(sorted(set(s.labels) - {"le", "finished_reason"})) for s in found[name].samples}
        assert label_sets == {("engine", "model_name")}, name
    assert f"vllm:prefix_cache_hits_total{{{L}}}" in text  # a counter's sample carries _total, as vLLM's does
    ttft_buckets = [s.labels["le"] for s in found["vllm:time_to_first_token_seconds"].samples
                    if s.name.endswith("_bucket")]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-2:] == ["2560.0", "+Inf"]


def test_series_move_with_requests_and_agree_with_ours(model_dir):
    prompt = list(range(100, 180))  # 80 tokens: 5 full blocks of 16 for the second request to hit
    with ServerThread(model_dir, served_model_name=MODEL) as server:
        before = server.metrics()
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0)
        for _ in range(2):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].finish_reason == "length"
        server.wait_blocks_free()
        after = server.metrics()
    moved = {k: after[k] - before.get(k, 0.0) for k in after}
    assert moved[f"vllm:time_to_first_token_seconds_count{{{L}}}"] == 2
    assert moved[f"vllm:e2e_request_latency_seconds_count{{{L}}}"] == 2
    assert moved[f"vllm:request_time_per_output_token_seconds_count{{{L}}}"] == 2
    assert moved[SUCCESS_LENGTH] == 2
    assert moved[f"vllm:inter_token_latency_seconds_count{{{L}}}"] == 2 * 5  # 6 tokens, one step each
    assert moved[f"vllm:time_per_output_token_seconds_count{{{L}}}"] == 2 * 5
    assert moved[f"vllm:prefix_cache_queries_total{{{L}}}"] == 2 * 80
    assert moved[f"vllm:prefix_cache_hits_total{{{L}}}"] >= 64  # the second request found the first's blocks
    assert moved[f"vllm:prompt_tokens_total{{{L}}}"] == 2 * 80
    assert moved[f"vllm:generation_tokens_total{{{L}}}"] == 2 * 6
    assert after[f"vllm:prefix_cache_hits_total{{{L}}}"] == after["kvserve_prefix_cache_hits_total"]
    assert after[f"vllm:e2e_request_latency_seconds_sum{{{L}}}"] == pytest.approx(
        after["kvserve_e2e_request_latency_seconds_sum"])
    tpot = moved[f"vllm:request_time_per_output_token_seconds_sum{{{L}}}"] / 2
    itl = moved[f"vllm:inter_token_latency_seconds_sum{{{L}}}"] / 10
    assert tpot == pytest.approx(itl)  # one token a step: the mean decode time per token is the mean gap
    assert after[f"vllm:num_requests_running{{{L}}}"] == after[f"vllm:kv_cache_usage_perc{{{L}}}"] == 0


def test_gauges_show_running_waiting_and_kv_usage_while_busy(model_dir):
    faults = Faults()
    with ServerThread(model_dir, engine_factory=FaultyEngine(faults), served_model_name=MODEL,
                      max_num_seqs=1) as server:
        faults.step_delay = 0.05
        body = {"prompt": "busy", "max_tokens": 60, "ignore_eos": True, "temperature": 0, "stream": True}
        calls = [start(server.base_url, body) for _ in range(2)]
        busy = scrape_until(server, {f"vllm:num_requests_running{{{L}}}": 1, f"vllm:num_requests_waiting{{{L}}}": 1})
        faults.step_delay = 0
        for call in calls:
            call.join(60)
        server.wait_blocks_free()
        idle = server.metrics()
    assert busy["kvserve_requests_running"] == 1 and busy["kvserve_requests_waiting"] == 1  # max_num_seqs=1
    usage = busy[f"vllm:kv_cache_usage_perc{{{L}}}"]
    assert usage == busy["kvserve_kv_blocks_used"] / busy["kvserve_kv_blocks_total"] and 0 < usage < 1
    assert idle[f"vllm:num_requests_running{{{L}}}"] == idle[f"vllm:num_requests_waiting{{{L}}}"] == 0
    assert idle[f"vllm:kv_cache_usage_perc{{{L}}}"] == 0


def test_engine_series_are_labelled_per_engine_core():
    """Several cores' CoreStats ({index: CoreStats}) give one series per core, labelled engine="i"."""
    stats = {0: CoreStats(num_running=3, num_blocks_total=10, num_blocks_used=5, prefix_cache_hits=7),
             1: CoreStats(num_waiting=2, num_blocks_total=10, num_blocks_used=1)}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmEngineCollector(lambda: stats, lambda: "m"))
    VllmRequestMetrics(registry).start("m", engines=2)
    m = parse_metrics(generate_latest(registry).decode())
    assert m['vllm:num_requests_running{engine="0",model_name="m"}'] == 3
    assert m['vllm:num_requests_waiting{engine="1",model_name="m"}'] == 2
    assert m['vllm:kv_cache_usage_perc{engine="0",model_name="m"}'] == 0.5
    assert m['vllm:prefix_cache_hits_total{engine="0",model_name="m"}'] == 7
    assert m['vllm:e2e_request_latency_seconds_count{engine="1",model_name="m"}'] == 0


def test_the_cores_stats_sum_counters_and_their_lists_element_by_element():
    """Several engine cores' CoreStats (what /metrics reads before the cores are named): counters add up, the
    seconds by section add up section by section, a core that reported fewer sections counts 0 for the rest."""
    from server.core_link import summed

    total = summed([CoreStats(num_running=1, busy_seconds=0.5, section_seconds=[1.0, 2.0]),
                    CoreStats(num_running=2, busy_seconds=0.25, section_seconds=[0.5])])
    assert (total.num_running, total.busy_seconds, total.section_seconds) == (3, 0.75, [1.5, 2.0])
    assert total.device_seconds == []


def test_kvserve_engine_series_are_summed_over_cores_and_labelled_per_core():
    """The plain kvserve_* engine series are the cores' sum (one core: its own numbers, as before data
    parallel); kvserve_core_*{engine="i"} are each core's, of the same type."""
    from server.metrics import ServerMetrics

    stats = {0: CoreStats(num_running=3, num_blocks_used=5, generation_tokens_total=7),
             1: CoreStats(num_running=1, num_waiting=2, num_blocks_used=1, generation_tokens_total=4)}
    metrics = ServerMetrics(lambda: stats[0])
    single = parse_metrics(metrics.render().decode())
    assert single["kvserve_requests_running"] == single['kvserve_core_requests_running{engine="0"}'] == 3
    assert 'kvserve_core_requests_running{engine="1"}' not in single
    metrics.name_engines("m", lambda: stats)
    text = metrics.render().decode()
    m = parse_metrics(text)
    assert (m["kvserve_requests_running"], m["kvserve_requests_waiting"], m["kvserve_kv_blocks_used"]) == (4, 2, 6)
    assert m["kvserve_generation_tokens_total"] == 11
    assert [m[f'kvserve_core_kv_blocks_used{{engine="{i}"}}'] for i in range(2)] == [5, 1]
    assert [m[f'kvserve_core_generation_tokens_total{{engine="{i}"}}'] for i in range(2)] == [7, 4]
    kinds = families(text)
    assert kinds["kvserve_core_kv_blocks_used"].type == kinds["kvserve_kv_blocks_used"].type == "gauge"
    assert kinds["kvserve_core_generation_tokens"].type == "counter"

