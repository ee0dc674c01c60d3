"""kvserve on Ray Serve: N replicas, each one `kvserve serve` (an engine core on its GPU or the CPU, and its
HTTP front end on a loopback port), behind an OpenAI-compatible ingress that routes by prompt prefix.

    serve run server.ray_serve:build_app num_replicas=2 num_gpus=1 serve_args="--model /models/qwen"

  Ray's HTTP proxy -> KvserveIngress (FastAPI: /v1/completions, /v1/chat/completions, /v1/models, /health)
      -> KvserveReplica.generate (chosen by server.ray_router.PrefixAffinityRouter from the prompt's prefix)
          -> its own `kvserve serve` on 127.0.0.1 (the body passes through; the answer streams back as is)

A replica runs kvserve as a child process (the CLI is the stable interface: the same flags, health, drain and
metrics as everywhere else) through server/ray_child.py: when the replica goes, however it goes (killed
included), the child's stdin closes and it drains and exits. Ray restarts a replica whose child died or
whose /health fails (check_health). Responses carry `x-kvserve-replica`, the replica that served them.

No `from __future__ import annotations` here: Ray Serve's class-based FastAPI ingress needs the route
methods' annotations (Request) as real objects, or FastAPI takes them for query parameters.
"""

import hashlib
import json
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.config import RequestRouterConfig

from server.errors import APIError
from server.ray_router import PrefixAffinityRouter

PASSED_HEADERS = ("retry-after", "cache-control", "x-request-id")


@dataclass
class ProxyRequest:
    """One HTTP request for a replica's kvserve; prefix_key steers the router (None: any replica)."""
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    prefix_key: str | None = None


@dataclass
class ResponseHead:
    """The first item a replica yields: the status and headers; the body's chunks follow."""
    status: int
    headers: dict[str, str]
    replica: str


def prompt_text(payload: object) -> str:
    """The text a request's KV blocks start with: the prompt, or the chat messages in order."""
    if not isinstance(payload, dict):
        return ""
    if "messages" in payload:
        return json.dumps(payload["messages"], ensure_ascii=False, sort_keys=True)
    prompt = payload.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prefix_key(body: bytes, prefix_chars: int) -> str | None:
    """A hash of the prompt's first prefix_chars characters: requests that agree on them share a key."""
    try:
        text = prompt_text(json.loads(body))
    except ValueError:
        return None
    return hashlib.blake2b(text[:prefix_chars].encode(), digest_size=16).hexdigest() if text else None


# ---- the replica -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KvserveReplica:
    """One kvserve server; generate() proxies a request to it and streams the answer back."""

    def __init__(self, serve_args: list[str], startup_timeout: float = 600.0, shutdown_timeout: float = 30.0):
        self.port, self.shutdown_timeout = free_port(), shutdown_timeout
        self.replica = serve.get_replica_context().replica_id.unique_id
        command = [sys.executable, "-m", "server.ray_child", "serve", *serve_args, "--host", "127.0.0.1",
                   "--port", str(self.port), "--shutdown-timeout", str(shutdown_timeout)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._wait_ready(startup_timeout)
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=None)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve exited with {self.proc.returncode} while starting")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self._stop()
        raise TimeoutError(f"kvserve was not ready within {timeout:.0f} s")

    async def generate(self, request: ProxyRequest):
        async with self.client.stream(request.method, request.path, content=request.body,
                                      headers=request.headers) as response:
            headers = {k: v for k, v in response.headers.items() if k in PASSED_HEADERS}
            headers["content-type"] = response.headers.get("content-type", "application/json")
            yield ResponseHead(response.status_code, headers, self.replica)
            async for chunk in response.aiter_raw():
                yield chunk

    async def check_health(self) -> None:
        """Ray calls it every health_check_period_s; raising makes Ray replace this replica."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvserve exited with {self.proc.returncode}")
        response = await self.client.get("/health", timeout=10)
        if response.status_code != 200:
            raise RuntimeError(f"kvserve /health {response.status_code}: {response.text[:200]}")

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the child drains (SIGTERM) and exits
            try:
                self.proc.wait(self.shutdown_timeout + 20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        self._stop()


# ---- the ingress -------------------------------------------------------------------------------------------
api = FastAPI(title="kvserve on Ray Serve")


@serve.ingress(api)
class KvserveIngress:
    """OpenAI-compatible routes; each request goes to the replica its prompt prefix maps to."""

    def __init__(self, replicas, prefix_chars: int = 256):
        self.replicas, self.prefix_chars = replicas, prefix_chars

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._forward(request, keyed=True)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._forward(request, keyed=True)

    @api.get("/v1/models")
    async def models(self, request: Request):
        return await self._forward(request, keyed=False)

    @api.get("/health")
    async def health(self):
        return JSONResponse({"status": "ok"})

    async def _forward(self, request: Request, keyed: bool):
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}
        key = prefix_key(body, self.prefix_chars) if keyed else None
        stream = self.replicas.options(stream=True).generate.remote(
            ProxyRequest(request.method, request.url.path, body, headers, key))
        try:
            head: ResponseHead = await stream.__anext__()
        except Exception as exc:  # the replica died or its kvserve is unreachable: retryable, OpenAI-shaped
            return APIError(503, f"the replica failed: {type(exc).__name__}", "engine_dead",
                            headers={"Retry-After": "1"}).response()
        return StreamingResponse(stream, status_code=head.status, headers={**head.headers,
                                                                            "x-kvserve-replica": head.replica})


# ---- the application ---------------------------------------------------------------------------------------
class AppArgs(BaseModel):
    """`serve run server.ray_serve:build_app KEY=VALUE ...`"""
    num_replicas: int = 2
    serve_args: str = ""  # more `kvserve serve` flags, e.g. "--model /models/qwen --max-num-seqs 128"
    num_gpus: float = 0.0  # per replica: 1 on a GPU cluster (Ray sets CUDA_VISIBLE_DEVICES for it)
    num_cpus: float = 1.0
    prefix_chars: int = 256  # requests agreeing on this many leading prompt characters share a replica
    max_ongoing_requests: int = 256  # per replica; beyond it the router tries the other replicas
    startup_timeout: float = 600.0
    shutdown_timeout: float = 30.0


def build_app(args: dict | AppArgs | None = None):
    args = args if isinstance(args, AppArgs) else AppArgs(**(args or {}))
    replica = serve.deployment(KvserveReplica).options(
        num_replicas=args.num_replicas, max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.num_cpus, "num_gpus": args.num_gpus},
        health_check_period_s=5, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=args.shutdown_timeout + 20,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter))
    ingress = serve.deployment(KvserveIngress).options(
        ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=4 * args.max_ongoing_requests)
    bound = replica.bind(shlex.split(args.serve_args), args.startup_timeout, args.shutdown_timeout)
    return ingress.bind(bound, args.prefix_chars)
