"""Soak test: thousands of mixed requests against one kvserve server, then check that nothing leaked.

    python benchmarks/soak.py                       # starts `python -m server serve` on the embedded default
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234
    python benchmarks/soak.py --model /path/to/tiny --num-requests 200 --json-out soak.json

The mix: random sampling parameters (temperature, top-p/k, min-p, penalties, seeds, n, stop strings,
logprobs, echo, logit bias), completions and chat, streaming and not, text and token-id prompts;
--disconnect-frac of the requests hang up at a random moment, --invalid-frac are invalid and must get
their documented 4xx, --oversized-frac are over a cap (a megabyte of prompt text, thousands of stop_token_ids
or logit_bias entries, /detokenize of 70,000 ids, n x max_tokens x logprobs too large) and must get their 4xx
at once, --slow-frac send their headers a few bytes at a time (within the header timeout: served), and
--never-read-frac start a stream with a tiny receive buffer, read nothing for a while, then hang up;
--structured-frac are checked structured requests: constrained outputs (small random JSON schemas, json_object,
regexes, choices; chat and completions, streamed and not, n up to 3) that must validate when they finish with
`stop` (and be an allowed prefix when cut off; a `<think>` regex is put back together from reasoning_content
under --reasoning-parser), tool calls (tool_choice required, named, or auto with a regex writing hermes calls;
start the server with --tool-call-parser hermes) whose arguments must validate against the tool's schema, and
prompt logprobs (echo + logprobs, prompt_logprobs) with one entry per prompt token, the same for the n choices.
A third of the hang-ups are constrained too (some right after sending, while the grammar compiles), and the
invalid requests include bad regexes and schemas (400 invalid_grammar), an unknown tool_choice name (400
invalid_value), min_tokens with a constraint and a streamed echo with logprobs (400 unsupported).
Reported, and the exit status is 0 only when all three hold:
  * unexpected failures (anything but the expected outcome of each request) == 0
  * leaked KV blocks (`kvserve_kv_blocks_used` once the server is idle again) == 0,
    and no idle-invariant violation (`kvserve_idle_invariant_violations_total`)
  * resident memory of the server process and its children (the engine core) grows by less than
    --max-rss-growth (10%) from after the warm-up to the end
Bounded in time: every request has a timeout and the whole run stops at --time-limit.
Only a client: it imports nothing of kvserve's engine or server (its structured requests and their checks are
in bench/soak_structured.py and bench/soak_checks.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from bench.soak_checks import check_reply, fetch_replies, same_prompt_logprobs  # noqa: E402
from bench.soak_spec import Spec, random_text  # noqa: E402
from bench.soak_structured import REGEXES, object_schema, structured_spec, tool_defs  # noqa: E402


# ------------------------------------------------------------------------------------------- the plan


def _sampling(rng: random.Random, max_tokens: int) -> dict:
    body = {"max_tokens": rng.randint(1, max_tokens),
            "temperature": rng.choice([0.0, 0.0, 0.5, 0.8, 1.0, 1.3]),
            "top_p": rng.choice([1.0, 1.0, 0.9, 0.5, 0.1]),
            "top_k": rng.choice([-1, -1, 0, 1, 5, 40]),
            "min_p": rng.choice([0.0, 0.0, 0.05, 0.2]),
            "presence_penalty": rng.choice([0.0, 0.0, 0.5, -0.5, 1.5]),
            "frequency_penalty": rng.choice([0.0, 0.0, 0.3, -0.3]),
            "repetition_penalty": rng.choice([1.0, 1.0, 1.1, 0.9]),
            "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2 ** 31)
    if rng.random() < 0.2:
        body["stop"] = rng.choice([".", "\n", [" the", " a"], ["ing"]])
    if rng.random() < 0.15:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.1:
        body["logit_bias"] = {str(rng.randrange(100, 1000)): rng.choice([-100.0, -5.0, 5.0])}
    return body


def valid_spec(rng: random.Random, index: int, model: str | None, max_tokens: int) -> Spec:
    body = _sampling(rng, max_tokens)
    if model:
        body["model"] = model
    stream = rng.random() < 0.5
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        body["messages"] = [{"role": "user", "content": random_text(rng, 1, 30)}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        return Spec(index, "valid", "/v1/chat/completions", body, stream=stream)
    shape = rng.random()
    if shape < 0.6:
        body["prompt"] = random_text(rng, 1, 60)
    elif shape < 0.8:
        body["prompt"] = [rng.randrange(100, 1000) for _ in range(rng.randint(1, 100))]
    else:
        body["prompt"], body["n"] = [random_text(rng, 1, 20) for _ in range(rng.randint(2, 3))], 1
    if rng.random() < 0.2:
        body["logprobs"] = rng.randint(0, 5)
    elif rng.random() < 0.1:
        body["echo"] = True
    return Spec(index, "valid", "/v1/completions", body, stream=stream)


def _constrain_for_disconnect(rng: random.Random, body: dict) -> None:
    """A third of the hang-ups are constrained: json_object (long: a random model rarely closes it), a JSON
    schema or a regex; the grammar may still be compiling when the client leaves."""
    r = rng.random()
    if r < 0.15:
        body["response_format"] = {"type": "json_object"}
    elif r < 0.25:
        body["structured_outputs"] = {"json": object_schema(rng, 2)}
    elif r < 0.33:
        body["guided_regex"] = rng.choice(REGEXES) + "( [a-z]{1,8}){0,40}"
    else:
        return
    body.pop("ignore_eos")


def disconnect_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    # Long enough (ignore_eos) that the hang-up usually comes while the request is still running.
    body = {"prompt": random_text(rng, 5, 150), "max_tokens": 256, "ignore_eos": True,
            "temperature": rng.choice([0.0, 1.0])}
    if model:
        body["model"] = model
    _constrain_for_disconnect(rng, body)
    hangup = rng.choice(["before_first_token", "mid_stream", "non_streaming"])
    stream = hangup != "non_streaming"
    if stream:
        body["stream"] = True
    after = rng.uniform(0.0, 0.5) if hangup == "non_streaming" else float(rng.randint(1, 8))
    if hangup == "non_streaming" and "ignore_eos" not in body and rng.random() < 0.5:
        after = rng.uniform(0.001, 0.03)  # right after sending: the grammar is likely still compiling
    return Spec(index, "disconnect", "/v1/completions", body, stream=stream, hangup=hangup, hangup_after=after)


def invalid_cases(model: str | None) -> list[tuple[str, dict | None, bytes | None, int, str]]:
    """(path, body, raw body, expected status, expected code)."""
    m = {"model": model} if model else {}
    c, chat = "/v1/completions", "/v1/chat/completions"
    return [
        (c, {**m, "prompt": "hi", "temperature": -1}, None, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "max_tokens": 0}, None, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "max_tokens": "16"}, None, 400, "invalid_type"),
        (c, {**m, "prompt": "hi", "top_p": 0}, None, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "n": 0}, None, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "logprobs": 21}, None, 400, "invalid_value"),
        (c, {**m, "prompt": []}, None, 400, "invalid_value"),
        (c, {**m, "prompt": [10 ** 9]}, None, 400, "invalid_value"),
        (c, {"prompt": "hi", "model": "no-such-model"}, None, 404, "model_not_found"),
        (c, None, b'{"prompt": "hi", ', 400, "invalid_json"),
        (chat, {**m, "messages": []}, None, 400, "invalid_value"),
        (chat, {**m, "messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "invalid_type"),
        (c, {**m, "prompt": "hi", "structured_outputs": {"regex": "a(b"}}, None, 400, "invalid_grammar"),
        (chat, {**m, "messages": [{"role": "user", "content": "hi"}], "guided_regex": "(("}, None, 400,
         "invalid_grammar"),
        (chat, {**m, "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, None, 400,
         "invalid_grammar"),
        (c, {**m, "prompt": "hi", "guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
         None, 400, "invalid_grammar"),
        (chat, {**m, "messages": [{"role": "user", "content": "hi"}], "tools": tool_defs(random.Random(0)),
                "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}, None, 400,
         "invalid_value"),
        (c, {**m, "prompt": "hi", "guided_regex": "a+", "min_tokens": 3}, None, 400, "unsupported"),
        (c, {**m, "prompt": "hi", "echo": True, "logprobs": 2, "stream": True}, None, 400, "unsupported"),
    ]


def invalid_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    path, body, raw, status, code = rng.choice(invalid_cases(model))
    return Spec(index, "invalid", path, body, raw=raw, expect_status=status, expect_code=code)


def oversized_cases(model: str | None) -> list[tuple[str, dict, int, str]]:
    """(path, body, expected status, expected code): each over one of the server's default caps."""
    m = {"model": model} if model else {}
    c = "/v1/completions"
    return [
        (c, {**m, "prompt": "1" * 1_000_000, "max_tokens": 1}, 400, "context_length_exceeded"),
        (c, {**m, "prompt": "hi", "max_tokens": 1, "stop_token_ids": list(range(5000))}, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(2000)}}, 400,
         "invalid_value"),
        (c, {**m, "prompt": "hi", "n": 64, "max_tokens": 8192, "logprobs": 20}, 400, "invalid_value"),
        ("/detokenize", {**m, "tokens": [5] * 70_000}, 400, "invalid_value"),
    ]


def oversized_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    path, body, status, code = rng.choice(oversized_cases(model))
    return Spec(index, "oversized", path, body, expect_status=status, expect_code=code)


def slow_spec(rng: random.Random, index: int, model: str | None, max_tokens: int) -> Spec:
    spec = valid_spec(rng, index, model, max_tokens)
    spec.kind, spec.stream = "slow", False
    spec.body.pop("stream", None)
    spec.body.pop("stream_options", None)
    spec.hangup_after = rng.uniform(0.5, 2.0)  # seconds over which the headers trickle in
    return spec


def never_read_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    body = {"prompt": random_text(rng, 5, 50), "max_tokens": 256, "ignore_eos": True, "stream": True, "n": 4,
            "logprobs": 5}
    if model:
        body["model"] = model
    return Spec(index, "never_read", "/v1/completions", body, stream=True, hangup_after=rng.uniform(1.0, 4.0))


def make_plan(num: int, seed: int, model: str | None, disconnect_frac: float, invalid_frac: float,
              max_tokens: int, oversized_frac: float = 0.0, slow_frac: float = 0.0,
              never_read_frac: float = 0.0, structured_frac: float = 0.0) -> list[Spec]:
    rng = random.Random(seed)
    makers = [(structured_frac, lambda i: structured_spec(rng, i, model)),
              (disconnect_frac, lambda i: disconnect_spec(rng, i, model)),
              (invalid_frac, lambda i: invalid_spec(rng, i, model)),
              (oversized_frac, lambda i: oversized_spec(rng, i, model)),
              (slow_frac, lambda i: slow_spec(rng, i, model, max_tokens)),
              (never_read_frac, lambda i: never_read_spec(rng, i, model))]
    plan = []
    for i in range(num):
        r, spec = rng.random(), None
        for frac, make in makers:
            if r < frac:
                spec = make(i)
                break
            r -= frac
        plan.append(spec or valid_spec(rng, i, model, max_tokens))
    return plan


# ------------------------------------------------------------------------------------------- running


@dataclass
class Outcome:
    index: int
    kind: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0
    form: str = ""  # "structured": its Check's form
    finishes: dict[str, int] = field(default_factory=dict)  # "structured": its choices by finish_reason


def _check_choices(data: dict, spec: Spec) -> str:
    """'' when a non-streamed 200 body is complete and sane, else what is wrong."""
    choices = data.get("choices")
    prompts = spec.body.get("prompt") if spec.body else None
    num_prompts = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], str) else 1
    want = spec.body.get("n", 1) * num_prompts
    if not isinstance(choices, list) or len(choices) != want:
        return f"expected {want} choices, got {choices if not isinstance(choices, list) else len(choices)}"
    bad = [c.get("finish_reason") for c in choices if c.get("finish_reason") not in ("stop", "length")]
    if bad:
        return f"finish_reason {bad}"
    usage = data.get("usage") or {}
    if usage.get("completion_tokens", 0) > spec.body["max_tokens"] * want:
        return f"usage {usage} beyond max_tokens"
    return ""


def _request_args(spec: Spec) -> dict:
    if spec.raw is not None:
        return {"content": spec.raw, "headers": {"content-type": "application/json"}}
    return {"json": spec.body}


async def run_plain(client: httpx.AsyncClient, spec: Spec) -> str:
    resp = await client.post(spec.path, **_request_args(spec))
    if spec.kind in ("invalid", "oversized"):
        code = _error_code(resp)
        if resp.status_code != spec.expect_status or code != spec.expect_code:
            return f"expected {spec.expect_status} {spec.expect_code}, got {resp.status_code} {code}"
        return ""
    if resp.status_code != 200:
        return f"status {resp.status_code}: {resp.text[:200]}"
    return _check_choices(resp.json(), spec)


def _error_code(resp: httpx.Response) -> str | None:
    try:
        return resp.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def run_stream(client: httpx.AsyncClient, spec: Spec) -> str:
    async with client.stream("POST", spec.path, json=spec.body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return f"status {resp.status_code}: {resp.text[:200]}"
        finished, done = set(), False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return f"stream error event {event['error']}"
            for choice in event.get("choices", []):
                if choice.get("finish_reason") is not None:
                    finished.add(choice["index"])
                    if choice["finish_reason"] not in ("stop", "length"):
                        return f"finish_reason {choice['finish_reason']}"
    return "" if done and finished else f"stream ended early (done={done}, finished={sorted(finished)})"


async def run_disconnect(client: httpx.AsyncClient, spec: Spec) -> str:
    """Hang up at the planned moment. Only a 5xx seen before hanging up is a failure."""
    if spec.hangup == "non_streaming":
        try:
            resp = await asyncio.wait_for(client.post(spec.path, json=spec.body), timeout=spec.hangup_after)
        except asyncio.TimeoutError:
            return ""
        return f"status {resp.status_code}" if resp.status_code >= 500 else ""
    async with client.stream("POST", spec.path, json=spec.body) as resp:
        if resp.status_code >= 500:
            return f"status {resp.status_code}"
        if spec.hangup == "before_first_token":
            return ""  # leaving the block unread closes the connection
        events = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                if "\"error\"" in line:
                    return f"stream error event before hanging up: {line[:200]}"
                events += 1
                if events >= spec.hangup_after:
                    break
    return ""


async def _raw_connection(base_url: str, rcvbuf: int | None = None):
    host, port = base_url.split("//", 1)[1].rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return await asyncio.open_connection(sock=sock)


def _raw_request(spec: Spec) -> bytes:
    body = json.dumps(spec.body).encode()
    return (f"POST {spec.path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


async def run_slow(base_url: str, spec: Spec) -> str:
    """Headers a few bytes at a time over hangup_after seconds (under the header timeout), then read it all."""
    reader, writer = await _raw_connection(base_url)
    data = _raw_request(spec)
    pieces = [data[i:i + 16] for i in range(0, len(data), 16)]
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(spec.hangup_after / len(pieces))
        response = await reader.read()
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return f"slow client got {head[:100]!r}"
    return ""


async def run_never_read(base_url: str, spec: Spec) -> str:
    """A stream that is never read (4 KiB receive buffer), then a hang-up: only the leak checks judge it."""
    _, writer = await _raw_connection(base_url, rcvbuf=4096)
    writer.write(_raw_request(spec))
    await asyncio.sleep(spec.hangup_after)
    writer.transport.abort()
    return ""


async def run_structured(client: httpx.AsyncClient, spec: Spec, finishes: dict[str, int]) -> str:
    """Send a structured request, count its choices' finish reasons, check every choice."""
    got = await fetch_replies(client, spec)
    if got["error"]:
        return got["error"]
    replies, want = got["replies"], spec.body.get("n", 1)
    if len(replies) != want:
        return f"expected {want} choices, got {len(replies)}"
    for reply in replies:
        finishes[str(reply["finish_reason"])] = finishes.get(str(reply["finish_reason"]), 0) + 1
    errors = [e for e in (check_reply(spec.check, r, got["usage"]) for r in replies) if e]
    if spec.check.form == "prompt_logprobs":
        errors += [same_prompt_logprobs(replies)]
    return next((e for e in errors if e), "")


async def run_one(client: httpx.AsyncClient, spec: Spec, timeout: float) -> Outcome:
    start = time.monotonic()
    base_url = str(client.base_url).rstrip("/")
    finishes: dict[str, int] = {}
    try:
        if spec.kind == "slow":
            coro = run_slow(base_url, spec)
        elif spec.kind == "never_read":
            coro = run_never_read(base_url, spec)
        elif spec.kind == "disconnect":
            coro = run_disconnect(client, spec)
        elif spec.kind == "structured":
            coro = run_structured(client, spec, finishes)
        elif spec.stream:
            coro = run_stream(client, spec)
        else:
            coro = run_plain(client, spec)
        detail = await asyncio.wait_for(coro, timeout=timeout)
    except asyncio.TimeoutError:
        detail = f"no answer within {timeout:.0f} s"
    except (httpx.HTTPError, ValueError, KeyError, TypeError, OSError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    form = spec.check.form if spec.check else ""
    return Outcome(spec.index, spec.kind, not detail, detail, time.monotonic() - start, form, finishes)


async def run_plan(base_url: str, plan: list[Spec], concurrency: int, timeout: float, time_limit: float,
                   progress: bool) -> list[Outcome]:
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in plan:
        queue.put_nowait(spec)
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(plan), desc="soak", disable=not progress, unit="req")
    deadline = time.monotonic() + time_limit
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty() and time.monotonic() < deadline:
                spec = queue.get_nowait()
                outcomes.append(await run_one(client, spec, min(timeout, max(1.0, deadline - time.monotonic()))))
                bar.update(1)
                if not outcomes[-1].ok:
                    bar.set_postfix(failures=sum(not o.ok for o in outcomes))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    bar.close()
    done = {o.index for o in outcomes}
    outcomes += [Outcome(s.index, s.kind, False, "not run: time limit reached") for s in plan if s.index not in done]
    return outcomes


# ------------------------------------------------------------------------------------------- the server


def read_metrics(client: httpx.Client) -> dict[str, float]:
    """Unlabelled samples by name, labelled ones as name{k=v,...}."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(client: httpx.Client, timeout: float) -> dict[str, float]:
    """The metrics once nothing runs or waits (or the last read at the timeout)."""
    end = time.monotonic() + timeout
    while True:
        m = read_metrics(client)
        idle = m.get("kvserve_requests_running", 0) == 0 and m.get("kvserve_requests_waiting", 0) == 0
        if (idle and m.get("kvserve_kv_blocks_used", 0) == 0) or time.monotonic() > end:
            return m
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m server serve` on a free loopback port; its output goes to a log file."""

    def __init__(self, model: str | None, extra_args: list[str], startup_timeout: float):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-soak-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "server", "serve", "--port", str(self.port), "--log-level", "warning"]
        cmd += (["--model", model] if model else []) + extra_args
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def rss(pid: int | None) -> int | None:
    """Resident bytes of the server: the process and all its children (the engine core is one: its grammar
    matchers, caches and KV pool live there, not in the front end that `pid` is)."""
    if not pid:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    return sum(_rss_of(p) for p in procs)


def _rss_of(proc: psutil.Process) -> int:
    """One process's resident bytes; 0 once it has gone."""
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


# ------------------------------------------------------------------------------------------- the report


@dataclass
class Report:
    num_requests: int
    by_kind: dict[str, int]
    unexpected_failures: int
    failures: list[dict]  # the first few, for the eye
    leaked_blocks: float
    idle_invariant_violations: float
    rss_start_bytes: int | None
    rss_end_bytes: int | None
    rss_growth: float | None
    elapsed_s: float
    requests_per_s: float
    finished_by_reason: dict[str, float]
    server_healthy_after: bool
    structured_finishes: dict[str, dict[str, int]] = field(default_factory=dict)  # form -> finish -> choices
    preemptions: float = float("nan")  # kvserve_preemptions_total at the end (a small --num-kv-blocks: many)
    criteria: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.criteria.values())


def structured_finishes(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """The structured requests' choices by form, then finish_reason (failed requests included)."""
    out: dict[str, dict[str, int]] = {}
    for o in outcomes:
        for reason, count in o.finishes.items():
            by_reason = out.setdefault(o.form, {})
            by_reason[reason] = by_reason.get(reason, 0) + count
    return out


def _finishes_row(r: Report) -> str:
    """'json_schema 40/52 stop, ...': how many of each constrained form's choices ended by themselves."""
    return ", ".join(f"{form} {c.get('stop', 0) + c.get('tool_calls', 0)}/{sum(c.values())} stop"
                     for form, c in sorted(r.structured_finishes.items())
                     if form not in ("echo", "prompt_logprobs")) or "none"


def make_report(plan, outcomes, metrics_end, rss_start, rss_end, elapsed, healthy, max_growth) -> Report:
    failed = sorted((o for o in outcomes if not o.ok), key=lambda o: o.index)
    kinds = {k: sum(s.kind == k for s in plan)
             for k in ("valid", "structured", "disconnect", "invalid", "oversized", "slow", "never_read")}
    growth = None if not rss_start or rss_end is None else (rss_end - rss_start) / rss_start
    reasons = {k.split("reason=")[1].rstrip("}"): v for k, v in metrics_end.items()
               if k.startswith("kvserve_requests_finished_total{")}
    report = Report(len(plan), kinds, len(failed), [asdict(o) for o in failed[:20]],
                    metrics_end.get("kvserve_kv_blocks_used", float("nan")),
                    metrics_end.get("kvserve_idle_invariant_violations_total", float("nan")),
                    rss_start, rss_end, growth, elapsed, len(plan) / elapsed if elapsed else 0.0, reasons, healthy,
                    structured_finishes(outcomes), metrics_end.get("kvserve_preemptions_total", float("nan")))
    report.criteria = {"no_unexpected_failures": not failed,
                       "no_leaked_blocks": report.leaked_blocks == 0 and report.idle_invariant_violations == 0,
                       "rss_growth_ok": growth is None or growth < max_growth,
                       "healthy_after": healthy}
    return report


def print_table(r: Report) -> None:
    mib = lambda b: "n/a" if b is None else f"{b / 2 ** 20:.1f} MiB"  # noqa: E731
    rows = [("requests", f"{r.num_requests} ({', '.join(f'{k} {v}' for k, v in r.by_kind.items())})"),
            ("unexpected failures", str(r.unexpected_failures)),
            ("leaked KV blocks (idle)", f"{r.leaked_blocks:g}"),
            ("idle-invariant violations", f"{r.idle_invariant_violations:g}"),
            ("RSS start -> end", f"{mib(r.rss_start_bytes)} -> {mib(r.rss_end_bytes)}"),
            ("RSS growth", "n/a" if r.rss_growth is None else f"{100 * r.rss_growth:+.2f}%"),
            ("structured choices", _finishes_row(r)),
            ("preemptions", f"{r.preemptions:g}"),
            ("finished by reason", ", ".join(f"{k} {v:g}" for k, v in sorted(r.finished_by_reason.items()))),
            ("elapsed", f"{r.elapsed_s:.1f} s ({r.requests_per_s:.1f} req/s)"),
            ("healthy after", str(r.server_healthy_after)),
            ("PASSED" if r.passed else "FAILED", ", ".join(k for k, ok in r.criteria.items() if not ok) or "all")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for f in r.failures:
        print(f"  failure #{f['index']} ({f['kind']}): {f['detail']}")


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="an already running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: the pid whose RSS to watch")
    p.add_argument("--model", default=None, help="model for the started server (default: the embedded SmolLM2)")
    p.add_argument("--served-model-name", default=None, help="model name to send (default: none, allowed)")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the started server")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect-frac", type=float, default=0.10)
    p.add_argument("--invalid-frac", type=float, default=0.05)
    p.add_argument("--oversized-frac", type=float, default=0.05)
    p.add_argument("--slow-frac", type=float, default=0.03)
    p.add_argument("--never-read-frac", type=float, default=0.03)
    p.add_argument("--structured-frac", type=float, default=0.15,
                   help="constrained outputs, forced tool calls and prompt logprobs, each checked")
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a valid request")
    p.add_argument("--warmup", type=int, default=20, help="valid requests before RSS is first measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--json-out", default="soak.json")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> Report:
    model = args.served_model_name
    # Structured requests in the warm-up too: the grammar tokenizer and compile caches are built once.
    warm = make_plan(args.warmup, args.seed + 1, model, 0.0, 0.0, args.max_tokens,
                     structured_frac=min(0.5, 2 * args.structured_frac))
    asyncio.run(run_plan(base_url, warm, args.concurrency, args.request_timeout, args.time_limit, False))
    with httpx.Client(base_url=base_url, timeout=30) as client:
        wait_idle(client, 60)
        rss_start = rss(pid)
        plan = make_plan(args.num_requests, args.seed, model, args.disconnect_frac, args.invalid_frac,
                         args.max_tokens, args.oversized_frac, args.slow_frac, args.never_read_frac,
                         args.structured_frac)
        start = time.monotonic()
        outcomes = asyncio.run(run_plan(base_url, plan, args.concurrency, args.request_timeout,
                                        args.time_limit, not args.no_progress))
        elapsed = time.monotonic() - start
        metrics_end = wait_idle(client, 60)
        rss_end = rss(pid)
        healthy = client.get("/health").status_code == 200
    return make_report(plan, outcomes, metrics_end, rss_start, rss_end, elapsed, healthy, args.max_rss_growth)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.base_url is None:
        print(f"starting a server ({args.model or 'the embedded default'}) ...", file=sys.stderr)
        server = ServerProcess(args.model, args.server_arg, args.startup_timeout)
    base_url = args.base_url or server.base_url
    pid = args.server_pid if server is None else server.proc.pid
    try:
        report = soak(args, base_url, pid)
    finally:
        exit_code = server.stop() if server is not None else None
    result = {**asdict(report), "passed": report.passed, "server_exit_code": exit_code,
              "args": {k: v for k, v in vars(args).items()}}
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print_table(report)
    if server is not None and exit_code != 0:
        print(f"the server exited with {exit_code}:\n{server.log_tail()}", file=sys.stderr)
    print(f"wrote {args.json_out}")
    return 0 if report.passed and exit_code in (0, None) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
