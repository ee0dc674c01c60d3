"""--data-parallel-size 2 on the CPU: two engine-core processes behind one front end (`python -m server serve`,
a real subprocess) serve the server suite's core cases. Outputs equal one engine's (greedy), streams and chat
work, both cores take requests, a disconnect frees its blocks, a full waiting queue answers 429 and the
disconnected requests' aborts reach their own cores (every core's kvserve_core_kv_blocks_used back to 0, the
per-core series summing to the plain ones), prefix-affinity dispatch finds cached prefixes where round robin
misses them, one core killed fails only its own requests while the other serves on, and SIGTERM drains both
cores' requests, then every process exits. The Dispatcher's rules are checked on their own first.

Two servers for the module: the affinity one (--max-num-seqs 1 per core and --max-waiting-requests 2, so a
queue fills with four requests) and a round-robin one (the prefix baseline, then the core that is killed).
"""
from __future__ import annotations

import contextlib
import json
import random
import signal
import time

import httpx
import psutil
import pytest
from openai import OpenAI

from conftest import build_tiny_model
from server.dispatch import BALANCE_ABS, Dispatcher
from server_utils import parse_metrics, start, start_server_process, stop_process, wait_for

MODEL = "tiny"
MAX_WAITING = 2
LONG = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}  # ~10 s each: aborted long before
ENGINE_GAUGES = ("requests_running", "requests_waiting", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached")
ENGINE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "prompt_tokens",
                   "generation_tokens", "engine_steps", "idle_invariant_violations", "grammar_process_restarts",
                   "structured_steps", "structured_mask_wait_seconds", "engine_busy_seconds")


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


# ---------------------------------------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer):
    """The tiny llama with room for 2,048 tokens, so a LONG request outlives every check made while it runs."""
    return str(build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-2k"), smollm2_tokenizer,
                                max_position_embeddings=2048))


def serve(model_dir: str, dispatch: str, *extra: str):
    return start_server_process(["--model", model_dir, "--device", "cpu", "--num-kv-blocks", "256",
                                 "--data-parallel-size", "2", "--data-parallel-dispatch", dispatch,
                                 "--api-server-count", "1", "--served-model-name", MODEL, "--log-level", "warning",
                                 "--retry-after", "3", *extra])


@contextlib.contextmanager
def running(*args):
    proc, base = serve(*args)
    try:
        yield proc, base
    finally:
        if proc.poll() is None:
            stop_process(proc, sig=signal.SIGKILL)


@pytest.fixture(scope="module")
def dp_server(model_dir):
    """Affinity dispatch; one running completion per core and two waiting in all fill it."""
    with running(model_dir, "affinity", "--max-num-seqs", "1", "--max-waiting-requests", str(MAX_WAITING)) as s:
        yield s


@pytest.fixture(scope="module")
def rr_server(model_dir):
    with running(model_dir, "round_robin") as s:
        yield s


def cores_of(proc) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if " ".join(p.cmdline()).strip() == "kvserve::engine-core"]


def metrics(base: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base + "/metrics", timeout=10).text)


def per_core(m: dict[str, float], name: str) -> list[float]:
    """kvserve_core_NAME{engine="0"} and {engine="1"}."""
    return [m[f'kvserve_core_{name}{{engine="{i}"}}'] for i in range(2)]


def assert_sums_are_totals(m: dict[str, float]) -> None:
    for name in ENGINE_GAUGES:
        assert sum(per_core(m, name)) == m[f"kvserve_{name}"], name
    for name in ENGINE_COUNTERS:
        assert sum(per_core(m, name + "_total")) == m[f"kvserve_{name}_total"], name


def wait_cores(base: str, want: dict[str, list[float]], timeout: float = 30) -> dict[str, float]:
    """Scrapes until every per-core series in `want` reads its values ([core 0, core 1]); returns that scrape."""
    end = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if all(per_core(m, name) == values for name, values in want.items()):
            return m
        assert time.monotonic() < end, f"timed out waiting for {want}: {[per_core(m, n) for n in want]}"
        time.sleep(0.05)


class HeldStream:
    """A streaming completion held open on its own connection, read one event at a time; leaving the
    ExitStack is the client hanging up."""

    def __init__(self, stack: contextlib.ExitStack, base: str, body: dict):
        http = stack.enter_context(httpx.Client(base_url=base, timeout=60))
        self.response = stack.enter_context(http.stream("POST", "/v1/completions", json={**body, "stream": True}))
        assert self.response.status_code == 200, self.response.read()
        self._lines = self.response.iter_lines()

    def next_event(self) -> dict:
        line = next(line for line in self._lines if line.startswith("data: "))
        return json.loads(line[len("data: "):])


def assert_overloaded(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "3"


def test_greedy_outputs_equal_one_engine_and_both_cores_serve(dp_server, model_dir):
    from engine import LLM, SamplingParams

    proc, base = dp_server
    prompts = [[11 + i, 23, 5 * i + 7, 42, 17 + 3 * i] for i in range(8)]
    before = metrics(base)
    client = OpenAI(base_url=base + "/v1", api_key="x")
    got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in prompts]
    llm = LLM(model=model_dir, device="cpu", num_kv_blocks=64)
    want = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for g, w in zip(got, want):
        assert g.choices[0].text == w.outputs[0].text
    after = wait_cores(base, {"requests_running": [0, 0]})
    moved = [a - b for a, b in zip(per_core(after, "prompt_tokens_total"), per_core(before, "prompt_tokens_total"))]
    assert all(n >= 5 for n in moved) and sum(moved) == 8 * 5, moved  # both cores served, every prompt counted once
    assert_sums_are_totals(after)


def test_streaming_chat_and_a_disconnect_free_every_block(dp_server):
    _, base = dp_server
    client = OpenAI(base_url=base + "/v1", api_key="x")
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0)
    assert chat.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks)
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"prompt": "go on", **LONG, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    m = wait_cores(base, {"kv_blocks_used": [0, 0], "requests_running": [0, 0]}, timeout=20)
    assert m["kvserve_requests_running"] == 0 and m["kvserve_idle_invariant_violations_total"] == 0


def test_a_full_queue_answers_429_and_aborts_reach_each_core(dp_server):
    """One LONG completion running on each core, one waiting behind each (the front end's waiting queue, 2,
    full): more work gets 429 and /ready 503 overloaded. Every core's series show it, and sum to the plain
    ones. Then every client hangs up: each abort must reach the core that holds the request (one sent
    elsewhere would leave it running its 1,900 tokens), so both cores' blocks are free long before that."""
    _, base = dp_server
    before = metrics(base)
    with contextlib.ExitStack() as stack:
        runners = [HeldStream(stack, base, {"prompt": f"runner {i}", **LONG}) for i in range(2)]
        for s in runners:
            assert "error" not in s.next_event()
        for i in range(MAX_WAITING):  # admitted (200, headers sent), then queued behind the runners
            HeldStream(stack, base, {"prompt": f"waiter {i}", **LONG})
        busy = wait_cores(base, {"requests_running": [1, 1], "requests_waiting": [1, 1]})
        assert_overloaded(httpx.post(base + "/v1/completions", json={"prompt": "one more", "max_tokens": 2}))
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        assert_overloaded(httpx.post(base + "/v1/chat/completions", json=chat))
        ready, health = httpx.get(base + "/ready"), httpx.get(base + "/health")
        assert ready.status_code == 503 and "overloaded" in ready.json()["detail"] and health.status_code == 200
    idle = wait_cores(base, {"kv_blocks_used": [0, 0], "requests_running": [0, 0], "requests_waiting": [0, 0]})
    assert_sums_are_totals(busy)
    assert all(n > 0 for n in per_core(busy, "kv_blocks_used"))
    generated = [a - b for a, b in zip(per_core(idle, "generation_tokens_total"),
                                       per_core(before, "generation_tokens_total"))]
    assert all(0 < n < LONG["max_tokens"] for n in generated), generated  # each core ran, and stopped early
    aborted = 'kvserve_requests_finished_total{reason="abort"}'
    assert idle[aborted] - before[aborted] == 4 and idle["kvserve_idle_invariant_violations_total"] == 0
    assert httpx.post(base + "/v1/completions", json={"prompt": "after", "max_tokens": 2}).status_code == 200
    assert httpx.get(base + "/ready").status_code == 200


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


def test_prefix_affinity_finds_cached_prefixes_round_robin_misses(dp_server, rr_server):
    affinity, round_robin = prefix_hit_rate(dp_server[1]), prefix_hit_rate(rr_server[1])
    assert affinity >= 1.5 * round_robin, (affinity, round_robin)


def test_one_core_killed_fails_its_requests_and_the_other_serves_on(rr_server):
    proc, base = rr_server
    children = psutil.Process(proc.pid).children(recursive=True)
    streams = [start(base, {"prompt": [100 + i, 7, 9], "max_tokens": 300, "ignore_eos": True, "stream": True})
               for i in range(4)]  # round robin: two on each core
    for s in streams:
        assert s.first.wait(60)
    cores_of(proc)[1].kill()
    for s in streams:
        s.join(120)
    failed = [s for s in streams if isinstance(s.events[-2], dict) and "error" in s.events[-2]]
    finished = [s for s in streams if s.finish_reasons == ["length"]]
    assert len(failed) == len(finished) == 2  # the dead core's failed, the rest ran on
    health, ready = httpx.get(base + "/health", timeout=10), httpx.get(base + "/ready", timeout=10)
    assert health.status_code == 503 and "died" in health.json()["detail"] and ready.status_code == 503
    m = metrics(base)  # the dead core holds nothing: its gauges read 0, its counters keep their last values
    assert per_core(m, "kv_blocks_total")[1] == per_core(m, "requests_running")[1] == 0
    assert per_core(m, "kv_blocks_total")[0] > 0 and per_core(m, "generation_tokens_total")[1] > 0
    assert_sums_are_totals(m)
    for i in range(4):  # new work goes to the live core
        assert httpx.post(base + "/v1/completions", json={"prompt": f"again {i}", "max_tokens": 3},
                          timeout=60).status_code == 200
    code, out = stop_process(proc, timeout=60)
    assert code == 0, out[-3000:]
    psutil.wait_procs(children, timeout=10)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_sigterm_drains_both_cores_then_every_process_exits(dp_server):
    """Runs last on dp_server: a stream running on each core when SIGTERM comes; new work is refused with 503
    while they finish, both end with finish_reason length, the launcher exits 0 and no child is left."""
    proc, base = dp_server
    children = psutil.Process(proc.pid).children(recursive=True)
    streams = [start(base, {"prompt": f"drain {i}", "max_tokens": 500, "ignore_eos": True, "stream": True})
               for i in range(2)]
    wait_cores(base, {"requests_running": [1, 1]})
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(base + "/ready", timeout=10).status_code == 503, what="/ready to turn 503")
    refused = httpx.post(base + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
    for s in streams:
        s.join(60)
    code, out = stop_process(proc, sig=None, timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert all(s.finish_reasons == ["length"] and s.events[-1] == "[DONE]" for s in streams)
    assert code == 0 and "Traceback" not in out, out[-3000:]
    psutil.wait_procs(children, timeout=10)
    assert len(children) >= 2 and not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
