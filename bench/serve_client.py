"""The lean streaming client of `kvserve bench serve`: one client process sends its share of the requests.

aiohttp (what vLLM's `bench serve` uses) over one keep-alive connection pool, request bodies encoded with orjson
before the clock starts, SSE lines parsed with orjson, and uvloop where it is installed. The work per chunk is
a line read, one JSON parse and two clock reads: against a stub server that streams as fast as it can, one such
process sustains the tokens/s in docs/benchmarking.md ("The client's ceiling"), and --num-workers multiplies it.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import orjson

JSON_HEADERS = {"Content-Type": "application/json"}


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


@dataclass
class ClientShare:
    """What one client process sends: requests (by their index in the whole run) at their arrival offsets."""
    base_url: str
    endpoint: str
    api_key: str | None
    trust_env: bool
    indices: list[int]
    bodies: list[dict]  # the JSON bodies, encoded in the worker before the start
    prompt_lens: list[int]
    expected_output_lens: list[int]
    offsets: list[float]  # seconds after the common start
    max_concurrency: int  # in flight at once from this process
    request_timeout: float


@dataclass(repr=False)  # asyncio's runner reprs its task's result at exit: not every request's timings
class ShareResult:
    indices: list[int]
    results: list[RequestResult]
    end_s: float  # when its last request finished, seconds after the common start


def make_session(base_url: str, api_key: str | None, pool: int, trust_env: bool):
    """One keep-alive pool that holds every request in flight; timeouts are ours (per request, whole stream)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=pool, limit_per_host=pool, ttl_dns_cache=300)
    return aiohttp.ClientSession(base_url, headers=headers, connector=connector, trust_env=trust_env,
                                 timeout=aiohttp.ClientTimeout(total=None), cookie_jar=aiohttp.DummyCookieJar())


async def first_model(session) -> str:
    async with session.get("/v1/models") as resp:
        resp.raise_for_status()
        models = (orjson.loads(await resp.read())).get("data") or []
    if not models:
        raise RuntimeError("the server lists no model at /v1/models: pass --model")
    return models[0]["id"]


def apply_event(event: dict, result: RequestResult, texts: list[str], now: float, sent: float,
                last: float | None) -> float | None:
    """Fold one SSE event into `result`; returns the time of the latest chunk that carried a choice."""
    if event.get("error"):
        raise RuntimeError(f"error in stream: {orjson.dumps(event['error']).decode()[:500]}")
    if choices := event.get("choices"):
        if last is None:
            result.ttft = now - sent
        else:
            result.itl.append(now - last)
        last = now
        texts.append(choices[0].get("text") or "")
    if usage := event.get("usage"):  # the final chunk (include_usage); some servers repeat it on every chunk
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.usage_reported = True
        if usage.get("prompt_tokens") is not None:
            result.prompt_len = int(usage["prompt_tokens"])
    return last


async def stream_completion(session, url: str, body: bytes, result: RequestResult, t0: float) -> None:
    """Send one streaming completion and time its chunks into `result` (vLLM's client-side timings)."""
    sent = time.perf_counter()
    result.start_time = sent - t0
    last, texts = None, []
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            text = (await resp.read()).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {resp.status}: {text[:500]}")
        pending = b""
        async for piece in resp.content.iter_any():  # whatever arrived: one await per read, not per line
            now = time.perf_counter()  # events that arrived together were received together
            lines = (pending + piece).split(b"\n")
            pending = lines.pop()  # an incomplete last line waits for the next read
            for line in lines:
                if not line.startswith(b"data:"):  # blank separators, SSE comments (keep-alives)
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                last = apply_event(orjson.loads(data), result, texts, now, sent, last)
    result.generated_text = "".join(texts)
    if last is None:
        raise RuntimeError("the stream ended without a single chunk carrying a choice")
    result.latency = last - sent
    result.success = True


async def timed_request(session, url: str, body: bytes, result: RequestResult, t0: float,
                        timeout: float) -> RequestResult:
    """One request under its timeout; a failure of any kind is recorded, never raised."""
    try:
        await asyncio.wait_for(stream_completion(session, url, body, result, t0), timeout)
    except asyncio.TimeoutError:
        result.success, result.error = False, f"timed out after {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - a benchmark counts failures, whatever their kind
        result.success, result.error = False, f"{type(e).__name__}: {e}"
    return result


async def send_share(share: ClientShare, t0: float, on_done: Callable[[], None]) -> ShareResult:
    """Send the share's requests at t0 + their offsets (t0 on the perf_counter clock), at most
    share.max_concurrency in flight; returns when every one has finished or failed."""
    bodies = [orjson.dumps(b) for b in share.bodies]
    semaphore = asyncio.Semaphore(share.max_concurrency)

    async def limited(i: int) -> RequestResult:
        arrived = time.perf_counter()
        result = RequestResult(share.prompt_lens[i], share.expected_output_lens[i])
        async with semaphore:
            await timed_request(session, share.endpoint, bodies[i], result, t0, share.request_timeout)
        result.queue_time = max(0.0, t0 + result.start_time - arrived)
        on_done()
        return result

    async with make_session(share.base_url, share.api_key, share.max_concurrency + 1, share.trust_env) as session:
        tasks = []
        for i, offset in enumerate(share.offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(i)))
        results = await asyncio.gather(*tasks)
    return ShareResult(share.indices, list(results), time.perf_counter() - t0)


def run_async(coro):
    """asyncio.run, on uvloop where it is installed (a cheaper event loop: more chunks/s per process)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def count_output_tokens(results: list[RequestResult], tokenizer) -> None:
    """Servers without stream usage: count with the tokenizer, else one token per chunk."""
    for r in results:
        if r.success and not r.usage_reported:
            if tokenizer is not None:
                r.output_tokens = len(tokenizer(r.generated_text, add_special_tokens=False).input_ids)
            else:
                r.output_tokens = len(r.itl) + 1
