"""A stub OpenAI completions server that streams as fast as it can: the yardstick for the bench client.

    python -m bench.stub_server --port 0      # prints "stub server listening on PORT", serves until killed

No model and no framework: raw asyncio (uvloop where installed), HTTP/1.1 keep-alive, every token its own SSE
event in its own HTTP chunk (vLLM-sized: ~180 bytes) written as soon as the last one was, then the usage event
and [DONE]. What the client measures against it is the client's own ceiling: how many streamed chunks per
second it parses (benchmarks/bench_client_ceiling.py). `GET /v1/models` lists one model, "stub".
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

MODEL = "stub"
SSE_HEADERS = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse(event: dict | str) -> bytes:
    data = event.encode() if isinstance(event, str) else orjson.dumps(event)
    return http_chunk(b"data: " + data + b"\n\n")


def token_event(finish: str | None) -> bytes:
    return sse({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": finish}]})


@dataclass(frozen=True)
class Frames:
    """The bytes of every event, encoded once: the server's work per token is one write."""
    token: bytes = token_event(None)
    last: bytes = token_event("length")
    done: bytes = sse("[DONE]") + b"0\r\n\r\n"


def json_response(status: str, body: dict) -> bytes:
    data = orjson.dumps(body)
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status.encode(), len(data), data))


async def stream(writer: asyncio.StreamWriter, body: dict, frames: Frames) -> None:
    n = int(body.get("max_tokens") or 16)
    prompt = body.get("prompt")
    prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
    writer.write(SSE_HEADERS)
    for i in range(n):
        writer.write(frames.last if i == n - 1 else frames.token)
        await writer.drain()  # waits only when the client is behind (the socket buffer is full)
        await asyncio.sleep(0)  # let the other streams write theirs
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        writer.write(sse({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
                          "choices": [], "usage": usage}))
    writer.write(frames.done)
    await writer.drain()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict]:
    """(method and path, the JSON body or {}) of one request; IncompleteReadError when the client is gone."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return " ".join(lines[0].split()[:2]), (orjson.loads(body) if body else {})


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: Frames) -> None:
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:  # keep-alive: one request after another on this connection
            target, body = await read_request(reader)
            if target == "GET /v1/models":
                writer.write(json_response("200 OK", {"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
            elif target == "POST /v1/completions" and body.get("stream"):
                await stream(writer, body, frames)
            else:
                writer.write(json_response("404 Not Found", {"error": {"message": f"stub: no {target}"}}))
            await writer.drain()
    writer.close()


async def serve(host: str, port: int) -> None:
    frames = Frames()
    server = await asyncio.start_server(lambda r, w: handle(r, w, frames), host, port, backlog=4096)
    print(f"stub server listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


@dataclass(frozen=True)
class RunningStub:
    url: str
    pid: int

    def cpu_seconds(self) -> float:
        """User + system CPU time the stub process has used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def running_stub(timeout_s: float = 30.0) -> Iterator[RunningStub]:
    """A stub server in its own process on a free loopback port, until the block ends."""
    root = str(Path(__file__).resolve().parents[1])  # this checkout's bench, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "bench.stub_server", "--port", "0"], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""  # the process prints its port once it listens
        if not line.startswith("stub server listening on"):
            raise RuntimeError(f"the stub server did not start within {timeout_s:g} s: {line!r}")
        yield RunningStub(f"http://127.0.0.1:{int(line.split()[-1])}", proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0: a free port (printed)")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.host, args.port))
    else:
        uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
