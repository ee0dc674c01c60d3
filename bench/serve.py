"""`kvserve bench serve`: load-test any OpenAI-compatible server the way vLLM's `bench serve` does.

Streams `POST /v1/completions` (ignore_eos, stream_options.include_usage), arrivals drawn as vLLM draws them,
and reports vLLM's metrics under vLLM's key names, so results of kvserve, vLLM, TGI or llama.cpp compare 1:1.
Nothing here is kvserve-specific. Bounded by design: a fixed number of requests, a timeout per request, and
loopback servers only unless --allow-remote. The client (bench/serve_client.py) is lean, and --num-workers
spreads it over processes (bench/serve_workers.py) so that it is not what limits a fast server.
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
from datetime import datetime

import numpy as np

from bench import engine_counters
from bench.datasets import SampleRequest, add_dataset_arguments, load_tokenizer, requests_from_args
from bench.serve_client import (ClientShare, RequestResult, count_output_tokens, first_model, make_session,
                                run_async, timed_request)
from bench.serve_metrics import GOODPUT_METRICS, compute_metrics, print_summary, write_plot
from bench.serve_workers import make_shares, run_shares
from bench.structured_mix import FORMS, constrain


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
    g.add_argument("--num-workers", type=int, default=1,
                   help="client processes to spread the requests over (request i to process i mod N): one "
                        "process parses a bounded number of streamed chunks per second (docs/benchmarking.md)")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request before it fails")
    g.add_argument("--num-warmups", type=int, default=1, help="warm-up requests before the measured run")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--extra-body", default=None, help='JSON merged into every request, e.g. \'{"temperature": 0}\'')
    g.add_argument("--structured-fraction", type=float, default=0.0,
                   help="share of requests that carry bench/structured_mix.py's JSON schema (0-1)")
    g.add_argument("--structured-form", choices=sorted(FORMS), default="structured_outputs",
                   help="how the schema is sent: structured_outputs (kvserve, vLLM >= 0.10.2), guided_json "
                        "(older vLLM) or response_format")
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
    if args.num_workers < 1:
        raise ValueError("--num-workers must be >= 1")
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

# ---------------------------------------------------------------------------------------------------- run


async def prepare(args, base_url: str, requests: list[SampleRequest]) -> tuple[str, list[dict]]:
    """(the model's name, every request's body) after --num-warmups requests; RuntimeError if one fails."""
    extra = json.loads(args.extra_body) if args.extra_body else {}
    async with make_session(base_url, args.api_key, 2, trust_env=args.allow_remote) as session:
        try:
            model = args.model or await asyncio.wait_for(first_model(session), args.request_timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"GET /v1/models timed out after {args.request_timeout:g} s") from None
        bodies = [build_payload(model, r, args.ignore_eos, extra) for r in requests]
        if args.structured_fraction:
            bodies = constrain(bodies, args.structured_fraction, args.seed, args.structured_form)
        for _ in range(args.num_warmups):
            warm = RequestResult(requests[0].prompt_len, requests[0].expected_output_len)
            await timed_request(session, args.endpoint, json.dumps(bodies[0]).encode(), warm,
                                time.perf_counter(), args.request_timeout)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed, check the arguments: {warm.error}")
    return model, bodies


def send_all(args, base_url: str, bodies: list[dict], requests: list[SampleRequest]) -> tuple[list, float]:
    """The measured run: requests go out at their drawn arrival times, at most --max-concurrency at once,
    from --num-workers client processes."""
    from tqdm.auto import tqdm

    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
    whole = ClientShare(base_url, args.endpoint, args.api_key, args.allow_remote, list(range(len(requests))),
                        bodies, [r.prompt_len for r in requests], [r.expected_output_len for r in requests],
                        offsets.tolist(), args.max_concurrency or len(requests), args.request_timeout)
    shares = make_shares(whole, args.num_workers, args.max_concurrency)
    with tqdm(total=len(requests), desc="requests", unit="req", disable=args.disable_tqdm) as pbar:
        return run_shares(shares, pbar.update)


def run_benchmark(args, base_url: str, requests: list[SampleRequest]) -> tuple[str, list, float, dict]:
    """Warm up, then run; returns (model, results, duration, the engine's figures over the run: from kvserve's
    /metrics, bench/engine_counters.py, else {}). Raises RuntimeError if the warm-up fails."""
    model, bodies = run_async(prepare(args, base_url, requests))
    workers = max(1, min(args.num_workers, len(requests), args.max_concurrency or len(requests)))
    print(f"Model: {model}; request rate: {args.request_rate}; burstiness: {args.burstiness} "
          f"({'Poisson' if args.burstiness == 1 else 'gamma'}); max concurrency: {args.max_concurrency}; "
          f"client processes: {workers}")
    counted = engine_counters.scrape(base_url)
    results, duration = send_all(args, base_url, bodies, requests)
    return model, results, duration, engine_counters.between(counted, engine_counters.scrape(base_url), duration)


# ------------------------------------------------------------------------------------------------- output


def result_record(args, model: str, metrics: dict, results: list[RequestResult], slos_ms: dict) -> dict:
    """vLLM's result keys, then the run's parameters and the per-request arrays (vLLM's names)."""
    record = dict(metrics)
    record.update({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "label": args.label, "backend": "openai",
        "base_url": args.base_url, "endpoint": args.endpoint, "model_id": model, "tokenizer_id": args.tokenizer,
        "dataset": args.dataset, "num_prompts": args.num_prompts, "seed": args.seed,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        **({f"prefix_repetition_{k}": getattr(args, f"prefix_repetition_{k}")
            for k in ("prefix_len", "suffix_len", "num_prefixes", "output_len")}
           if args.dataset == "prefix_repetition" else {}),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "num_workers": args.num_workers,
        "ignore_eos": args.ignore_eos,
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


# --------------------------------------------------------------------------------------------------- main


def main(args: argparse.Namespace) -> int:
    try:
        base_url, slos_ms, percentiles = check_args(args)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        requests = requests_from_args(args, tokenizer)
        model, results, duration, engine = run_benchmark(args, base_url, requests)
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
            json.dump({**result_record(args, model, metrics, results, slos_ms), "engine": engine}, f, indent=1)
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
