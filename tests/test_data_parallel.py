"""--data-parallel-size 2 on the CPU: two engine-core processes behind one front end. Outputs equal one
engine's (greedy), streams and chat work, both cores take requests, a disconnect frees its blocks,
prefix-affinity dispatch finds cached prefixes where round robin misses them, and one core killed fails
only its own requests while the other serves on. The Dispatcher's rules are checked on their own first.
"""
from __future__ import annotations

import random
import signal
import time

import httpx
import psutil
import pytest
from openai import OpenAI

from server.dispatch import BALANCE_ABS, Dispatcher
from server_utils import parse_metrics, start, start_server_process, stop_process, wait_for

MODEL = "tiny"


# ---------------------------------------------------------------------------------------------- dispatcher
def test_same_prefix_goes_to_the_same_core_and_new_prefixes_to_the_least_loaded():
    d = Dispatcher(2, "affinity", block_size=4)
    doc = list(range(100, 140))  # 10 full blocks
    first = d.choose(doc + [1], [0, 0], [True, True])
    assert d.choose(doc + [2, 3], [5, 0], [True, True]) == first  # the cached prefix wins over a small imbalance
    assert d.choose([7] * 40, [3, 0], [True, True]) == 1  # no known prefix: the least loaded
    assert d.choose([9, 9], [0, 3], [True, True]) == 0  # shorter than a block: by load


def test_a_much_busier_core_loses_its_prefix_and_a_dead_core_is_never_chosen():
    d = Dispatcher(2, "affinity", block_size=4)
    doc = list(range(40))
    core = d.choose(doc, [0, 0], [True, True])
    busy = [0, 0]
    busy[core] = BALANCE_ABS * 3
    assert d.choose(doc, busy, [True, True]) == 1 - core
    alive = [True, True]
    alive[1 - core] = False
    assert d.choose([5] * 40, [100, 0] if core == 0 else [0, 100], alive) == core


def test_round_robin_alternates_over_the_live_cores():
    d = Dispatcher(3, "round_robin")
    assert [d.choose([1], [0, 0, 0], [True, True, True]) for _ in range(4)] == [0, 1, 2, 0]
    assert [d.choose([1], [0, 0, 0], [True, False, True]) for _ in range(3)] == [2, 0, 2]


# ---------------------------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def serve(model_dir: str, dispatch: str = "affinity"):
    return start_server_process(["--model", model_dir, "--device", "cpu", "--num-kv-blocks", "256",
                                 "--data-parallel-size", "2", "--data-parallel-dispatch", dispatch,
                                 "--api-server-count", "1", "--served-model-name", MODEL, "--log-level", "warning"])


@pytest.fixture(scope="module")
def dp_server(model_dir):
    proc, base = serve(model_dir)
    yield proc, base
    if proc.poll() is None:
        stop_process(proc, sig=signal.SIGKILL)


def cores_of(proc) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if " ".join(p.cmdline()).strip() == "kvserve::engine-core"]


def metrics(base: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base + "/metrics", timeout=10).text)


def test_greedy_outputs_equal_one_engine_and_both_cores_serve(dp_server, model_dir):
    from engine import LLM, SamplingParams

    proc, base = dp_server
    prompts = [[11 + i, 23, 5 * i + 7, 42, 17 + 3 * i] for i in range(8)]
    before = [c.cpu_times().user for c in cores_of(proc)]
    client = OpenAI(base_url=base + "/v1", api_key="x")
    got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in prompts]
    after = [c.cpu_times().user for c in cores_of(proc)]
    llm = LLM(model=model_dir, device="cpu", num_kv_blocks=64)
    want = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for g, w in zip(got, want):
        assert g.choices[0].text == w.outputs[0].text
    assert len(before) == 2 and all(a - b > 0.05 for a, b in zip(after, before))  # both cores stepped


def test_streaming_chat_and_a_disconnect_free_every_block(dp_server):
    _, base = dp_server
    client = OpenAI(base_url=base + "/v1", api_key="x")
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"prompt": "go on", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_for(lambda: metrics(base)["kvserve_kv_blocks_used"] == 0, timeout=20, what="blocks to be freed")
    m = metrics(base)
    assert m["kvserve_requests_running"] == 0 and m["kvserve_idle_invariant_violations_total"] == 0


def prefix_hit_rate(base: str, seed: int = 0) -> float:
    """16 shared prefixes of 64 ids (4 blocks of 16), each sent twice with different 5-id suffixes, in a
    shuffled order, one at a time: the share of prompt tokens found in the prefix cache. Affinity sends a
    prefix's second request to the core that has it (hit rate 64 / 138); round robin does so only when the
    two happen to land on the same core (about half the time)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(64)] for _ in range(16)]
    prompts = [p + [rng.randrange(1000, 30000) for _ in range(5)] for p in prefixes for _ in range(2)]
    rng.shuffle(prompts)
    m0 = metrics(base)
    for prompt in prompts:
        r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    m1 = metrics(base)
    hits = m1["kvserve_prefix_cache_hits_total"] - m0["kvserve_prefix_cache_hits_total"]
    queries = m1["kvserve_prefix_cache_queries_total"] - m0["kvserve_prefix_cache_queries_total"]
    return hits / queries


def test_prefix_affinity_finds_cached_prefixes_round_robin_misses(dp_server, model_dir):
    affinity = prefix_hit_rate(dp_server[1])
    proc, base = serve(model_dir, "round_robin")
    try:
        round_robin = prefix_hit_rate(base)
    finally:
        stop_process(proc)
    assert affinity >= 1.5 * round_robin, (affinity, round_robin)


def test_one_core_killed_fails_its_requests_and_the_other_serves_on(dp_server):
    proc, base = dp_server
    children = psutil.Process(proc.pid).children(recursive=True)
    streams = [start(base, {"prompt": [100 + i, 7, 9], "max_tokens": 300, "ignore_eos": True, "stream": True})
               for i in range(4)]
    for s in streams:
        assert s.first.wait(60)
    cores_of(proc)[1].kill()
    for s in streams:
        s.join(120)
    failed = [s for s in streams if isinstance(s.events[-2], dict) and "error" in s.events[-2]]
    finished = [s for s in streams if s.finish_reasons == ["length"]]
    assert failed and finished and len(failed) + len(finished) == 4  # the dead core's failed, the rest ran on
    health, ready = httpx.get(base + "/health", timeout=10), httpx.get(base + "/ready", timeout=10)
    assert health.status_code == 503 and "died" in health.json()["detail"] and ready.status_code == 503
    for i in range(4):  # new work goes to the live core
        assert httpx.post(base + "/v1/completions", json={"prompt": f"again {i}", "max_tokens": 3},
                          timeout=60).status_code == 200
    code, out = stop_process(proc, timeout=60)
    assert code == 0, out[-3000:]
    psutil.wait_procs(children, timeout=10)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
