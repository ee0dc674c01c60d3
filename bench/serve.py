"""`kvserve bench serve`: load-test any OpenAI-compatible server the way vLLM's `bench serve` does.

Streams `POST /v1/completions` (ignore_eos, stream_options.include_usage), arrivals drawn as vLLM draws them,
and reports vLLM's metrics under vLLM's key names, so results of kvserve, vLLM, TGI or llama.cpp compare 1:1.
Nothing here is kvserve-specific. Bounded by design: a fixed number of requests, a timeout per request, and
loopback servers only unless --allow-remote.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

from bench.datasets import SampleRequest, add_dataset_arguments, load_tokenizer, requests_from_args

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = (("ttft", "TTFT", "Time to First Token"),
                   ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                   ("itl", "ITL", "Inter-token Latency"),
                   ("e2el", "E2EL", "End-to-end Latency"))


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_tokens: int = 0
    usage_reported: bool = False
    ttft: float = 0.0  # seconds from sending to the first chunk with a choice
    itl: list[float] = field(default_factory=list)  # gaps between consecutive chunks with a choice
    latency: float = 0.0  # E2EL: sending to the last chunk with a choice
    start_time: float = 0.0  # when it was sent, seconds after the benchmark started
    queue_time: float = 0.0  # time spent waiting for the --max-concurrency semaphore
    generated_text: str = ""
    error: str = ""


# ---------------------------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer directory or .gguf file: random prompts become text as vLLM sends them "
                             "(without one they are token-id lists)")
    add_dataset_arguments(parser)
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, or inf: all at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 is Poisson, < 1 burstier, > 1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request before it fails")
    g.add_argument("--num-warmups", type=int, default=1, help="warm-up requests before the measured run")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--extra-body", default=None, help='JSON merged into every request, e.g. \'{"temperature": 0}\'')
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (env OPENAI_API_KEY)")
    g.add_argument("--allow-remote", action="store_true", help="allow a base URL that is not loopback")
    o = parser.add_argument_group("results")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    o.add_argument("--percentiles", default="90,99", help="comma-separated percentiles to report")
    o.add_argument("--result-json", default=None, help="write every figure, the parameters and per-request data")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="CDFs of TTFT/ITL/E2EL and throughput over time")
    o.add_argument("--label", default=None, help="a name for this run in the JSON (e.g. kvserve, vllm)")
    o.add_argument("--disable-tqdm", action="store_true")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {pair!r} is not KEY:MILLISECONDS") from None
        if name not in GOODPUT_METRICS or ms < 0:
            raise ValueError(f"--goodput: {pair!r}: KEY is one of {GOODPUT_METRICS}, MILLISECONDS >= 0")
        slos[name] = ms
    return slos


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost: we do not resolve it to find out


def check_base_url(url: str, allow_remote: bool) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must be http(s)://HOST[:PORT], got {url!r}")
    if not allow_remote and not _is_loopback(parts.hostname):
        raise ValueError(f"--base-url {url!r} is not a loopback address: pass --allow-remote to load-test it")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def check_args(args: argparse.Namespace) -> tuple[str, dict[str, float], list[float]]:
    """Validated (base URL, goodput SLOs, percentiles); ValueError says what is wrong."""
    base_url = check_base_url(args.base_url, args.allow_remote)
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not args.request_timeout > 0:
        raise ValueError("--request-timeout must be > 0")
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    if not all(0 < p < 100 for p in percentiles):
        raise ValueError("--percentiles must lie in (0, 100)")
    return base_url, parse_goodput(args.goodput), percentiles


# ----------------------------------------------------------------------------------------------- requests


def arrival_offsets(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """When each request is sent, in seconds after the start: vLLM's draw. Gaps are gamma(shape=burstiness,
    scale=1/(rate*burstiness)) (exponential, i.e. Poisson arrivals, at burstiness 1), then rescaled so the
    last goes out at n/rate, as vLLM does, so that runs with different seeds offer the same load."""
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    return offsets * (n / request_rate / offsets[-1])


def build_payload(model: str, req: SampleRequest, ignore_eos: bool, extra_body: dict) -> dict:
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.expected_output_len, "stream": True,
               "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body)
    return payload


def _apply_event(event: dict, result: RequestResult, now: float, sent: float, last: float | None) -> float | None:
    """Fold one SSE event into `result`; returns the time of the latest chunk that carried a choice."""
    if event.get("error"):
        raise RuntimeError(f"error in stream: {json.dumps(event['error'])[:500]}")
    if choices := event.get("choices"):
        if last is None:
            result.ttft = now - sent
        else:
            result.itl.append(now - last)
        last = now
        result.generated_text += choices[0].get("text") or ""
    if usage := event.get("usage"):  # the final chunk (include_usage); some servers repeat it on every chunk
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.usage_reported = True
        if usage.get("prompt_tokens") is not None:
            result.prompt_len = int(usage["prompt_tokens"])
    return last


async def stream_completion(client, url: str, payload: dict, result: RequestResult, t0: float) -> None:
    """Send one streaming completion and time its chunks into `result` (vLLM's client-side timings)."""
    sent = time.perf_counter()
    result.start_time = sent - t0
    last = None
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {body[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):  # blank separators, SSE comments (keep-alives)
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            last = _apply_event(json.loads(data), result, time.perf_counter(), sent, last)
    if last is None:
        raise RuntimeError("the stream ended without a single chunk carrying a choice")
    result.latency = last - sent
    result.success = True


async def timed_request(client, url: str, payload: dict, req: SampleRequest, t0: float,
                        timeout: float) -> RequestResult:
    """One request under its timeout; a failure of any kind is recorded, never raised."""
    result = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.expected_output_len)
    try:
        await asyncio.wait_for(stream_completion(client, url, payload, result, t0), timeout)
    except asyncio.TimeoutError:
        result.success, result.error = False, f"timed out after {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - a benchmark counts failures, whatever their kind
        result.success, result.error = False, f"{type(e).__name__}: {e}"
    return result


def count_output_tokens(results: list[RequestResult], tokenizer) -> None:
    """Servers without stream usage: count with the tokenizer, else one token per chunk."""
    for r in results:
        if r.success and not r.usage_reported:
            if tokenizer is not None:
                r.output_tokens = len(tokenizer(r.generated_text, add_special_tokens=False).input_ids)
            else:
                r.output_tokens = len(r.itl) + 1


# ---------------------------------------------------------------------------------------------------- run


def _make_client(base_url: str, api_key: str | None, pool: int, trust_env: bool):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Timeouts are ours (per request, whole stream); the pool must hold every request in flight.
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(None),
                             limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
                             trust_env=trust_env)


async def first_model(client) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError("the server lists no model at /v1/models: pass --model")
    return models[0]["id"]


async def send_all(client, args, payloads: list[dict], requests: list[SampleRequest]) -> tuple[list, float]:
    """The measured run: requests go out at their drawn arrival times, at most --max-concurrency at once."""
    from tqdm.auto import tqdm

    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
    semaphore = asyncio.Semaphore(args.max_concurrency or len(requests))
    pbar = tqdm(total=len(requests), desc="requests", unit="req", disable=args.disable_tqdm)

    async def limited(payload: dict, req: SampleRequest) -> RequestResult:
        arrived = time.perf_counter()
        async with semaphore:
            result = await timed_request(client, args.endpoint, payload, req, t0, args.request_timeout)
        result.queue_time = max(0.0, t0 + result.start_time - arrived)
        pbar.update(1)
        return result

    t0 = time.perf_counter()
    tasks = []
    for payload, req, offset in zip(payloads, requests, offsets):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(payload, req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    pbar.close()
    return list(results), duration


async def run_benchmark(args, base_url: str, requests: list[SampleRequest]) -> tuple[str, list, float]:
    """Warm up, then run; returns (model, results, duration). Raises RuntimeError if the warm-up fails."""
    pool = min(len(requests), args.max_concurrency or len(requests)) + 1
    extra = json.loads(args.extra_body) if args.extra_body else {}
    async with _make_client(base_url, args.api_key, pool, trust_env=args.allow_remote) as client:
        model = args.model or await first_model(client)
        payloads = [build_payload(model, r, args.ignore_eos, extra) for r in requests]
        for i in range(args.num_warmups):
            warm = await timed_request(client, args.endpoint, payloads[0], requests[0], time.perf_counter(),
                                       args.request_timeout)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed, check the arguments: {warm.error}")
        print(f"Model: {model}; request rate: {args.request_rate}; burstiness: {args.burstiness} "
              f"({'Poisson' if args.burstiness == 1 else 'gamma'}); max concurrency: {args.max_concurrency}")
        results, duration = await send_all(client, args, payloads, requests)
    return model, results, duration


# ------------------------------------------------------------------------------------------------ metrics


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


# ------------------------------------------------------------------------------------------------- output


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


def result_record(args, model: str, metrics: dict, results: list[RequestResult], slos_ms: dict) -> dict:
    """vLLM's result keys, then the run's parameters and the per-request arrays (vLLM's names)."""
    record = dict(metrics)
    record.update({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "label": args.label, "backend": "openai",
        "base_url": args.base_url, "endpoint": args.endpoint, "model_id": model, "tokenizer_id": args.tokenizer,
        "dataset": args.dataset, "num_prompts": args.num_prompts, "seed": args.seed,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
        "request_timeout": args.request_timeout, "goodput": slos_ms or None,
        "requests_without_usage": sum(r.success and not r.usage_reported for r in results),
        "input_lens": [r.prompt_len for r in results],
        "expected_output_lens": [r.expected_output_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results], "start_times": [r.start_time for r in results],
        "queue_times": [r.queue_time for r in results], "errors": [r.error for r in results],
        "generated_texts": [r.generated_text for r in results],
    })
    return record


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


# --------------------------------------------------------------------------------------------------- main


def main(args: argparse.Namespace) -> int:
    try:
        base_url, slos_ms, percentiles = check_args(args)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        requests = requests_from_args(args, tokenizer)
        model, results, duration = asyncio.run(run_benchmark(args, base_url, requests))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 1
    count_output_tokens(results, tokenizer)
    metrics = compute_metrics(results, duration, slos_ms, percentiles)
    print_summary(metrics, args, percentiles)
    for r in [r for r in results if not r.success][:10]:
        print(f"failed request: {r.error}", file=sys.stderr)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result_record(args, model, metrics, results, slos_ms), f, indent=1)
    if args.plot:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        write_plot(args.plot, results, duration, f"{args.label or f'{model} @ {base_url}'}: {len(requests)} "
                                                 f"requests, rate {rate}, max concurrency {args.max_concurrency}")
    return 0 if metrics["completed"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve bench serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
