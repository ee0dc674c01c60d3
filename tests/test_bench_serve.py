"""`kvserve bench serve`: datasets, arrivals, metric definitions, and whole runs against a streaming server.

The stand-in below is a tiny OpenAI-style completions server whose behaviour each test controls (failures,
chunks of several tokens, no usage): what a real server will not do on demand.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest

from bench import serve as bench_serve
from bench.datasets import jsonl_requests, prefix_repetition_requests, random_requests, sharegpt_requests
from bench import serve_metrics
from bench.serve_client import RequestResult

VLLM_KEYS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests"] + [
    f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p90", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")]
PER_REQUEST_KEYS = ["ttfts", "itls", "input_lens", "output_lens", "errors", "latencies", "expected_output_lens"]


# ------------------------------------------------------------------------------------------- stand-in server


def make_standin_app(tokens_per_chunk: int = 1, send_usage: bool = True, delay_s: float = 0.002):
    """Streams max_tokens tokens as OpenAI's completions API does. Prompts (strings) that start with a
    keyword misbehave: 'reject' -> HTTP 400, 'midstream' -> an error event after two chunks,
    'hang' -> never answers, 'empty' -> [DONE] without a single token."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "standin", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        prompt, n = body["prompt"], body["max_tokens"]
        kind = prompt.split()[0] if isinstance(prompt, str) else "ok"
        if kind == "reject":
            return JSONResponse({"error": {"message": "prompt rejected", "code": "invalid_value"}}, 400)
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        async def events():
            if kind == "hang":
                await asyncio.sleep(3600)
            sent = 0
            while sent < n and kind != "empty":
                if kind == "midstream" and sent >= 2:
                    yield f"data: {json.dumps({'error': {'message': 'engine step failed'}})}\n\n"
                    return
                await asyncio.sleep(delay_s)
                k = min(tokens_per_chunk, n - sent)
                sent += k
                choice = {"index": 0, "text": " tok" * k, "finish_reason": "length" if sent == n else None}
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
            if send_usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                         "total_tokens": prompt_tokens + sent}
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve_in_thread(app):
    """Start uvicorn on a free loopback port; returns (base_url, stop)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "stand-in server did not start"

    def stop():
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture
def standin(request):
    url, stop = serve_in_thread(make_standin_app(**getattr(request, "param", {})))
    yield url
    stop()


def run_bench(base_url: str, tmp_path, *extra: str, name: str = "result") -> tuple[int, dict | None]:
    out = tmp_path / f"{name}.json"
    args = bench_serve.build_parser().parse_args(
        ["--base-url", base_url, "--result-json", str(out), "--disable-tqdm", "--goodput", "ttft:10000",
         "tpot:1000", *extra])
    rc = bench_serve.main(args)
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def check_complete_run(result: dict, num: int) -> None:
    for key in VLLM_KEYS + PER_REQUEST_KEYS:
        assert key in result and result[key] is not None, key
    assert result["completed"] == num and result["failed"] == 0
    assert len(result["ttfts"]) == num
    for ttft, e2el in zip(result["ttfts"], result["latencies"]):
        assert 0 < ttft <= e2el
    assert result["output_lens"] == result["expected_output_lens"]
    assert result["total_output_tokens"] == sum(result["expected_output_lens"])
    assert result["errors"] == [""] * num


# -------------------------------------------------------------------------------------------------- datasets


def test_random_dataset_lengths_are_uniform_in_the_range_and_seeded():
    reqs = random_requests(400, input_len=100, output_len=40, range_ratio=0.5, seed=3, vocab_size=500)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and min(outs) >= 20 and max(outs) <= 60
    assert max(ins) - min(ins) > 80  # spread over the range, not a constant
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(0 <= t < 500 for r in reqs for t in r.prompt)
    again = random_requests(400, input_len=100, output_len=40, range_ratio=0.5, seed=3, vocab_size=500)
    other = random_requests(400, input_len=100, output_len=40, range_ratio=0.5, seed=4, vocab_size=500)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert [r.prompt for r in other] != [r.prompt for r in reqs]
    fixed = random_requests(5, input_len=7, output_len=3, range_ratio=0.0, vocab_size=500)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(7, 3)}
    with pytest.raises(ValueError):
        random_requests(1, 10, 10, range_ratio=1.0)


def test_random_dataset_with_a_tokenizer_sends_text_of_the_asked_length(smollm2_tokenizer):
    reqs = random_requests(20, input_len=64, output_len=8, seed=0, tokenizer=smollm2_tokenizer)
    specials = set(smollm2_tokenizer.all_special_ids)
    for r in reqs:
        assert isinstance(r.prompt, str)
        ids = smollm2_tokenizer.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_len
        assert not specials & set(ids)
    # Re-encoding may merge a token or two; vLLM tops up and trims, so nearly all land exactly on the target.
    assert sum(r.prompt_len == 64 for r in reqs) >= 18


def test_prefix_repetition_dataset_shares_each_prefix_among_its_requests(smollm2_tokenizer):
    reqs = prefix_repetition_requests(24, prefix_len=32, suffix_len=8, num_prefixes=3, output_len=5, seed=1,
                                      vocab_size=700)
    assert len(reqs) == 24 and {(r.prompt_len, r.expected_output_len) for r in reqs} == {(40, 5)}
    assert all(len(r.prompt) == 40 and all(0 <= t < 700 for t in r.prompt) for r in reqs)
    groups: dict[tuple, list] = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt[:32]), []).append(tuple(r.prompt[32:]))
    assert sorted(len(g) for g in groups.values()) == [8, 8, 8]  # 3 prefixes, 8 requests each
    assert len({s for g in groups.values() for s in g}) == 24  # every suffix its own
    order = [tuple(r.prompt[:32]) for r in reqs]
    assert any(a != b for a, b in zip(order, order[1:8]))  # shuffled: a prefix's requests are not all adjacent
    assert [r.prompt for r in prefix_repetition_requests(24, 32, 8, 3, 5, seed=1, vocab_size=700)] == [
        r.prompt for r in reqs]
    with pytest.raises(ValueError, match="multiple"):
        prefix_repetition_requests(10, 32, 8, 3, 5)
    texts = prefix_repetition_requests(4, 24, 6, 2, 3, tokenizer=smollm2_tokenizer)
    for r in texts:  # text prompts: a request's text starts with its prefix's text, shared by one other
        assert isinstance(r.prompt, str) and 26 <= r.prompt_len <= 34
        assert sum(o.prompt[:40] == r.prompt[:40] for o in texts) == 2


def test_sharegpt_and_jsonl_datasets(tmp_path, smollm2_tokenizer):
    convs = [{"conversations": [{"from": "human", "value": f"question number {i} " * 3},
                                {"from": "gpt", "value": f"an answer of some length {i} " * (i + 1)}]}
             for i in range(6)]
    convs.append({"conversations": [{"from": "human", "value": "one turn only"}]})
    convs.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a b c d e f"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_requests(path, 6, seed=1, tokenizer=smollm2_tokenizer)
    assert len(reqs) == 6 and all(r.prompt.startswith("question number") for r in reqs)  # "hi" is too short
    for r in reqs:
        i = int(r.prompt.split()[2])
        assert r.expected_output_len == len(smollm2_tokenizer(f"an answer of some length {i} " * (i + 1)).input_ids)
    fixed = sharegpt_requests(path, 10, seed=1, tokenizer=None, output_len=5)
    assert len(fixed) == 7 + 3 and {r.expected_output_len for r in fixed} == {5}  # oversampled to 10
    with pytest.raises(ValueError):
        sharegpt_requests(path, 3, tokenizer=None)

    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text('{"prompt": "hello there", "output_len": 4}\n\n{"prompt": [1, 2, 3], "output_len": 2}\n')
    got = jsonl_requests(jsonl, 10)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in got] == [
        ("hello there", 0, 4), ([1, 2, 3], 3, 2)]
    jsonl.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError):
        jsonl_requests(jsonl, 10)


# -------------------------------------------------------------------------------------- arrivals and checks


def test_arrivals_are_vllms_gamma_draw():
    rng = np.random.default_rng(0)
    assert not bench_serve.arrival_offsets(50, float("inf"), 1.0, rng).any()
    steady = bench_serve.arrival_offsets(10, 4.0, float("inf"), rng)
    assert np.allclose(np.diff(steady), 0.25) and steady[-1] == pytest.approx(2.5)

    def gap_cv(burstiness: float) -> float:
        t = bench_serve.arrival_offsets(5000, 10.0, burstiness, np.random.default_rng(1))
        gaps = np.diff(np.concatenate([[0.0], t]))
        assert t[-1] == pytest.approx(500.0)  # rescaled so the offered load is exactly n / rate
        assert (gaps >= 0).all()
        return gaps.std() / gaps.mean()

    # A gamma with shape k has coefficient of variation 1/sqrt(k): 1 for Poisson arrivals.
    assert gap_cv(1.0) == pytest.approx(1.0, abs=0.06)
    assert gap_cv(0.25) == pytest.approx(2.0, abs=0.2)
    assert gap_cv(4.0) == pytest.approx(0.5, abs=0.04)


def test_base_url_must_be_loopback_unless_allowed():
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000/", "http://127.0.0.2"):
        assert bench_serve.check_base_url(url, allow_remote=False).startswith("http")
    assert bench_serve.check_base_url("http://127.0.0.1:8000/v1/", False) == "http://127.0.0.1:8000"
    for url in ("http://10.0.0.1:8000", "https://api.example.com", "http://0.0.0.0:8000"):
        with pytest.raises(ValueError, match="allow-remote"):
            bench_serve.check_base_url(url, allow_remote=False)
        assert bench_serve.check_base_url(url, allow_remote=True)
    with pytest.raises(ValueError):
        bench_serve.check_base_url("ftp://127.0.0.1", allow_remote=True)
    args = bench_serve.build_parser().parse_args(["--base-url", "http://10.1.2.3:8000", "--disable-tqdm"])
    assert bench_serve.main(args) == 1  # refused before any request


def test_goodput_slos_parse():
    assert bench_serve.parse_goodput(["ttft:200", "tpot:12.5"]) == {"ttft": 200.0, "tpot": 12.5}
    for bad in (["ttft"], ["latency:5"], ["e2el:-1"], ["tpot:fast"]):
        with pytest.raises(ValueError):
            bench_serve.parse_goodput(bad)


def _result(start, ttft, itl, out, prompt=10, ok=True) -> RequestResult:
    r = RequestResult(prompt_len=prompt, expected_output_len=out, success=ok, output_tokens=out, ttft=ttft,
                      itl=list(itl), start_time=start, usage_reported=True)
    r.latency = ttft + sum(itl)
    return r


def test_metrics_follow_vllms_definitions():
    results = [
        _result(0.0, 0.1, [0.02, 0.02, 0.02], 4),  # TPOT 0.02, E2EL 0.16
        _result(0.0, 0.5, [0.1] * 9, 10),  # TPOT 0.1, E2EL 1.4
        _result(2.0, 0.2, [], 1),  # one token: no TPOT, no ITL
        _result(1.0, 0.0, [], 5, ok=False),
    ]
    m = serve_metrics.compute_metrics(results, duration=4.0, slos_ms={"ttft": 300, "tpot": 50},
                                    percentiles=[50, 90, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 15
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(15 / 4)
    assert m["total_token_throughput"] == pytest.approx(45 / 4)
    assert m["request_goodput"] == pytest.approx(2 / 4)  # the second misses both SLOs; the 1-token one meets TPOT
    assert m["mean_tpot_ms"] == pytest.approx((20 + 100) / 2)
    assert m["mean_ttft_ms"] == pytest.approx((100 + 500 + 200) / 3)
    assert m["median_e2el_ms"] == pytest.approx(200)
    assert m["mean_itl_ms"] == pytest.approx((3 * 20 + 9 * 100) / 12)
    assert m["p50_itl_ms"] == pytest.approx(100)
    assert m["max_concurrent_requests"] == 2  # the failed one does not count
    assert serve_metrics.compute_metrics(results, 4.0, {}, [99])["request_goodput"] is None


def test_peak_concurrency_treats_intervals_as_half_open():
    back_to_back = [_result(0.0, 0.5, [0.5], 2), _result(1.0, 0.5, [0.5], 2), _result(2.0, 1.0, [], 1)]
    assert serve_metrics.peak_concurrency(back_to_back) == 1
    assert serve_metrics.peak_concurrency(back_to_back + [_result(0.5, 1.0, [1.0], 2)]) == 2


# ------------------------------------------------------------------------------------------------ whole runs


def test_thirty_requests_at_a_finite_rate_and_at_inf_with_a_cap(standin, tmp_path):
    common = ["--num-prompts", "30", "--random-input-len", "16", "--random-output-len", "12",
              "--random-range-ratio", "0.5"]
    rc, finite = run_bench(standin, tmp_path, *common, "--request-rate", "40", name="finite")
    assert rc == 0
    check_complete_run(finite, 30)
    assert finite["request_rate"] == 40.0 and finite["max_concurrency"] is None
    assert min(finite["expected_output_lens"]) >= 6 and max(finite["expected_output_lens"]) <= 18
    starts = sorted(finite["start_times"])
    assert starts[-1] - starts[0] > 0.4  # 30 arrivals at 40/s are spread over ~0.75 s, not sent at once
    assert all(8 <= n <= 24 for n in finite["input_lens"]) and len(set(finite["input_lens"])) > 3

    rc, capped = run_bench(standin, tmp_path, *common, "--max-concurrency", "3", name="capped")
    assert rc == 0
    check_complete_run(capped, 30)
    assert capped["request_rate"] == "inf" and capped["max_concurrency"] == 3
    assert 1 <= capped["max_concurrent_requests"] <= 3
    assert capped["request_goodput"] == pytest.approx(capped["request_throughput"])  # generous SLOs
    assert capped["engine"] == {}  # a server without kvserve's engine counters: no engine figures


@pytest.mark.parametrize("standin", [{"tokens_per_chunk": 3}], indirect=True)
def test_output_tokens_come_from_usage_not_from_chunks(standin, tmp_path):
    rc, result = run_bench(standin, tmp_path, "--num-prompts", "5", "--random-input-len", "8",
                           "--random-output-len", "9")
    assert rc == 0
    check_complete_run(result, 5)
    assert result["output_lens"] == [9] * 5
    assert all(len(itl) == 2 for itl in result["itls"])  # 3 chunks of 3 tokens
    assert result["requests_without_usage"] == 0


@pytest.mark.parametrize("standin", [{"send_usage": False}], indirect=True)
def test_without_usage_each_chunk_counts_one_token(standin, tmp_path):
    rc, result = run_bench(standin, tmp_path, "--num-prompts", "4", "--random-input-len", "8",
                           "--random-output-len", "6")
    assert rc == 0 and result["output_lens"] == [6] * 4 and result["requests_without_usage"] == 4


def test_failed_requests_are_counted_not_crashed_on(standin, tmp_path):
    kinds = ["ok", "reject", "ok", "midstream", "hang", "ok", "reject", "empty", "ok", "midstream", "ok", "reject"]
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"{k} please", "output_len": 5}) + "\n" for k in kinds))
    rc, result = run_bench(standin, tmp_path, "--dataset", str(jsonl), "--num-prompts", "100",
                           "--request-timeout", "1.5", "--max-concurrency", "4")
    assert rc == 0
    bad = [k != "ok" for k in kinds]
    assert result["completed"] == kinds.count("ok") and result["failed"] == sum(bad)
    assert [bool(e) for e in result["errors"]] == bad
    errors = dict(zip(kinds, result["errors"]))
    assert "HTTP 400" in errors["reject"] and "engine step failed" in errors["midstream"]
    assert "timed out" in errors["hang"] and "without a single chunk" in errors["empty"]
    assert result["output_lens"] == [5 if not b else 0 for b in bad]
    assert result["total_output_tokens"] == 5 * kinds.count("ok")


def test_a_failing_warm_up_stops_the_run(standin, tmp_path, capsys):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps({"prompt": "reject this", "output_len": 3}) + "\n")
    rc, result = run_bench(standin, tmp_path, "--dataset", str(jsonl))
    assert rc == 1 and result is None
    assert "warm-up request failed" in capsys.readouterr().err


def test_plot_has_four_panels_and_is_a_png(standin, tmp_path):
    png = tmp_path / "run.png"
    rc, result = run_bench(standin, tmp_path, "--num-prompts", "20", "--random-input-len", "8",
                           "--random-output-len", "10", "--request-rate", "50", "--plot", str(png))
    assert rc == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    height, width, _ = imread(str(png)).shape
    assert (width, height) == (1200, 800)
    results = [_result(s, t, itl, len(itl) + 1) for s, t, itl in zip(
        result["start_times"], result["ttfts"], result["itls"])]
    fig = serve_metrics.make_figure(results, result["duration"], "t")
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 4
    assert [t.split()[0] for t in titles] == ["TTFT", "ITL", "E2EL", "Output"]
    assert all(ax.lines for ax in fig.axes)  # every panel has data drawn


# --------------------------------------------------------------------------------------- the real kvserve


@pytest.fixture(scope="module")
def kvserve_url(tiny_model_dir):
    from tests.server_utils import ServerThread

    with ServerThread(tiny_model_dir("llama"), max_model_len=256) as server:
        yield server.base_url


def test_real_server_thirty_requests_finite_rate_and_capped_inf(kvserve_url, tiny_model_dir, tmp_path):
    common = ["--num-prompts", "30", "--random-input-len", "16", "--random-output-len", "6",
              "--random-range-ratio", "0.5"]
    # Token-id prompts (no tokenizer), arriving as a Poisson process at 30 requests/s.
    rc, finite = run_bench(kvserve_url, tmp_path, *common, "--request-rate", "30", name="finite")
    assert rc == 0
    check_complete_run(finite, 30)
    assert finite["model_id"]  # found through /v1/models
    sent = [len(r.prompt) for r in random_requests(30, 16, 6, 0.5, seed=0)]
    assert finite["input_lens"] == sent  # the server's usage.prompt_tokens agrees with what was sent
    engine = finite["engine"]  # kvserve's engine over the timed run (the warm-up request left out)
    assert 0 < engine["steps"] and engine["masked_steps"] == 0 and 0 < engine["busy_share"] <= 1.05
    assert 1.0 <= engine["tokens_per_step"] <= 30  # 30 requests, each of up to 9 tokens
    # Text prompts (vLLM's way, through the model's tokenizer), all at once, at most 10 in flight.
    rc, capped = run_bench(kvserve_url, tmp_path, *common, "--max-concurrency", "10", "--tokenizer",
                           str(tiny_model_dir("llama")), "--plot", str(tmp_path / "real.png"), name="capped")
    assert rc == 0
    check_complete_run(capped, 30)
    assert 1 <= capped["max_concurrent_requests"] <= 10
    assert (tmp_path / "real.png").read_bytes()[:4] == b"\x89PNG"


def test_real_server_rejections_are_counted(kvserve_url, tmp_path):
    rows = [{"prompt": [5, 6, 7, 8], "output_len": 4}, {"prompt": [10**9], "output_len": 4},  # id out of vocab
            {"prompt": list(range(100, 400)), "output_len": 4},  # longer than max_model_len 256
            {"prompt": "a text prompt", "output_len": 4}]
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, result = run_bench(kvserve_url, tmp_path, "--dataset", str(jsonl))
    assert rc == 0
    assert (result["completed"], result["failed"]) == (2, 2)
    assert [bool(e) for e in result["errors"]] == [False, True, True, False]
    assert all("HTTP 400" in e for e in result["errors"] if e)
    assert result["output_lens"] == [4, 0, 0, 4]
