"""--data-parallel-size 2 with --api-server-count 2 (`python -m server serve`, a real subprocess): two engine
cores behind two front-end processes that share the port, each front end spreading its requests over both
cores by itself. Completions on new connections (the kernel spreads them over the front ends) equal one
engine's greedy outputs and reach both cores; streams carry the same text; SIGTERM drains streams running on
both cores, then the launcher, both cores and both front ends exit. One server for the module.
"""
from __future__ import annotations

import signal
import time

import httpx
import psutil
import pytest

from server_utils import parse_metrics, start, start_server_process, stop_process, wait_for

MODEL = "tiny"
PROMPTS = [[11 + i, 23, 5 * i + 7, 42, 17 + 3 * i] for i in range(8)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    proc, base = start_server_process(["--model", model_dir, "--device", "cpu", "--num-kv-blocks", "128",
                                       "--data-parallel-size", "2", "--api-server-count", "2",
                                       "--served-model-name", MODEL, "--log-level", "warning"])
    yield proc, base
    if proc.poll() is None:
        stop_process(proc, sig=signal.SIGKILL)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[str]:
    """One engine's greedy texts for PROMPTS."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model_dir, device="cpu", num_kv_blocks=64)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]


def metrics(base: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base + "/metrics", timeout=10).text)


def per_core(m: dict[str, float], name: str) -> list[float]:
    return [m[f'kvserve_core_{name}{{engine="{i}"}}'] for i in range(2)]


def quiet(base: str, span: float = 0.6) -> dict[str, float]:
    """A scrape once the engine counters have read the same for `span` s (over two heartbeats: every front
    end has every core's latest stats)."""
    last, since = None, time.monotonic()
    while True:
        m = metrics(base)
        if m["kvserve_generation_tokens_total"] != last:
            last, since = m["kvserve_generation_tokens_total"], time.monotonic()
        elif time.monotonic() - since >= span:
            return m
        time.sleep(0.05)


def body(prompt, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def test_completions_equal_one_engine_and_reach_both_cores(server, expected):
    _, base = server
    before = quiet(base)
    for prompt, want in zip(PROMPTS, expected):  # a new connection each
        r = httpx.post(base + "/v1/completions", json=body(prompt), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    after = quiet(base)  # the front end that answers may not have run a core's requests: its stats come later
    moved = [a - b for a, b in zip(per_core(after, "prompt_tokens_total"), per_core(before, "prompt_tokens_total"))]
    assert all(n >= 5 for n in moved) and sum(moved) == 5 * len(PROMPTS), moved


def test_streams_carry_the_same_text(server, expected):
    _, base = server
    calls = [start(base, body(prompt, stream=True)) for prompt in PROMPTS]
    for call, want in zip(calls, expected):
        call.join(60)
        assert call.events[-1] == "[DONE]" and call.finish_reasons == ["length"]
        assert "".join(c["text"] for e in call.events[:-1] for c in e["choices"]) == want


def settled(base: str, generated: float, timeout: float = 10) -> dict[str, float]:
    """A scrape whose engine counters show `generated` tokens: each core's stats reach every front end, the
    ones that ran none of its requests within a heartbeat (0.25 s) of it going idle."""
    end = time.monotonic() + timeout
    while (m := metrics(base))["kvserve_generation_tokens_total"] != generated:
        assert time.monotonic() < end, f"generation tokens {m['kvserve_generation_tokens_total']} != {generated}"
        time.sleep(0.02)
    return m


def test_metrics_sum_the_front_ends_and_split_the_cores(server):
    """--api-server-count 2: every scrape sums both front ends' histograms and counters. --data-parallel-size
    2: one vllm:* and kvserve_core_* series per engine core (engine="0", "1"), each request observed under the
    core that ran it, whichever front end answers the scrape."""
    _, base = server
    before = quiet(base)
    for i in range(8):  # a new connection each: the kernel spreads them over both front ends
        r = httpx.post(base + "/v1/completions", json=body(f"hello {i}", max_tokens=3, ignore_eos=True), timeout=60)
        assert r.status_code == 200, r.text
    scrapes = [settled(base, before["kvserve_generation_tokens_total"] + 8 * 3) for _ in range(4)]

    def series(name: str, extra: str = "") -> list[str]:  # NAME{engine="i",...} for both cores
        return [f'{name}{{engine="{i}",{extra}model_name="{MODEL}"}}' for i in range(2)]

    def moved(m: dict[str, float], keys: list[str]) -> list[float]:
        return [m[k] - before[k] for k in keys]

    for m in scrapes:
        e2e = moved(m, series("vllm:e2e_request_latency_seconds_count"))
        assert sum(e2e) == 8 and sum(moved(m, series("vllm:time_to_first_token_seconds_count"))) == 8
        assert sum(moved(m, series("vllm:request_success_total", 'finished_reason="length",'))) == 8
        generated = series("vllm:generation_tokens_total")
        assert moved(m, generated) == [3 * n for n in e2e]  # each core's count agrees with what the front ends saw
        assert [m[k] for k in generated] == per_core(m, "generation_tokens_total")
        assert sum(per_core(m, "prompt_tokens_total")) == m["kvserve_prompt_tokens_total"]
        assert sum(1 for k in m if k.startswith("vllm:num_requests_running{")) == 2  # per core, not per front end


def test_sigterm_drains_both_cores_through_both_front_ends_then_all_exit(server):
    """Runs last: four streams (each front end dispatches its own over both cores) running at SIGTERM; new
    work gets 503 while they finish with finish_reason length; exit 0 and no child of the launcher left."""
    proc, base = server
    children = psutil.Process(proc.pid).children(recursive=True)
    titles = sorted(" ".join(p.cmdline()).strip() for p in children)
    streams = [start(base, body(f"drain {i}", max_tokens=400, ignore_eos=True, stream=True)) for i in range(4)]
    end = time.monotonic() + 30
    while not all(n >= 1 for n in per_core(metrics(base), "requests_running")):
        assert time.monotonic() < end, "both cores never ran at once"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(base + "/ready", timeout=10).status_code == 503, what="/ready to turn 503")
    refused = httpx.post(base + "/v1/completions", json=body("late"), timeout=10)
    for s in streams:
        s.join(60)
    code, out = stop_process(proc, sig=None, timeout=60)
    assert titles.count("kvserve::engine-core") == 2
    assert {"kvserve::api-server-0", "kvserve::api-server-1"} <= set(titles)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert all(s.finish_reasons == ["length"] and s.events[-1] == "[DONE]" for s in streams)
    assert code == 0 and "Traceback" not in out, out[-3000:]
    psutil.wait_procs(children, timeout=10)
    assert not [p.cmdline() for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


LAUNCHER = """
import logging, multiprocessing as mp, os, signal, sys, threading, time
from server.launcher import _wait_for_front_ends
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
ctx = mp.get_context("spawn")
procs = [ctx.Process(target=time.sleep, args=(60,), name=f"front-{i}") for i in range(2)]
for p in procs:
    p.start()
if sys.argv[1] == "stop":  # the launcher is told to stop: front ends that die of the SIGTERM are the stop
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
else:  # one front end dies on its own: the others are stopped, and that is a failure
    threading.Timer(1.0, procs[0].kill).start()
code = _wait_for_front_ends(procs)
print("exit", code, [p.exitcode for p in procs])
"""


@pytest.mark.parametrize("how", ["stop", "crash"])
def test_the_launcher_tells_a_stop_from_a_front_end_that_died(how):
    """Real processes: a SIGTERM to the launcher stops every front end and exits 0 with no error logged, even when
    they die of the signal itself (-15); a front end killed on its own stops the others and the launcher exits 1
    with an error."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LAUNCHER, how], capture_output=True, text=True, timeout=60)
    last = done.stdout.strip().splitlines()[-1]
    if how == "stop":
        assert last == "exit 0 [-15, -15]" and "ERROR" not in done.stdout, done.stdout + done.stderr
    else:
        assert last == "exit 1 [-9, -15]" and "ERROR front end front-0 exited with -9" in done.stdout, done.stdout
