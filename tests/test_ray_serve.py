"""kvserve on Ray Serve (server/ray_serve.py), on a local Ray cluster on the CPU with two replicas of a tiny
model: requests through Ray's HTTP proxy are answered as HF greedy generate answers them, a shared-prefix
workload lands on the replica that holds the prefix (and hits its prefix cache), and killing one replica
leaves the other serving (and the killed one's kvserve exits). Skipped where Ray is not installed
(`pip install -e .[ray]`; the README's test command installs it, so CI runs these). One cluster for the
module: it starts in ~30 s on 2 cores (the file runs in ~40 s); timeouts are generous (STARTUP_TIMEOUT,
RECOVERY_TIMEOUT) and every wait polls, none sleeps a fixed time.
"""
from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from server.ray_router import rank_replicas  # noqa: E402
from server.ray_serve import AppArgs, build_app, free_port, prefix_key  # noqa: E402
from server_utils import sse_events  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 240.0  # one replica's kvserve to /ready: ~10-30 s on 2 busy cores
RECOVERY_TIMEOUT = 60.0  # after a replica is killed, until the routers stop choosing it
PREFIXES = [f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(60)) + "\n" for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    """One local Ray cluster (4 logical CPUs on this machine) for the module, and the kvserve app on Ray's HTTP
    proxy; yields its base URL. serve.run returns once both replicas' kvserve answer /ready (each replica
    waits up to STARTUP_TIMEOUT for it). The cluster is torn down with ray.shutdown alone: it kills the
    replicas, and their kvserve children, watching the replica's pipe, drain and exit (checked), where
    serve.shutdown would first wait ~12 s for the replacement of the replica the last test kills."""
    import ray
    from ray import serve

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = AppArgs(num_replicas=2, num_cpus=0.5, startup_timeout=STARTUP_TIMEOUT,
                       serve_args=f"--model {model_dir} --device cpu --num-kv-blocks 256 --api-server-count 1 "
                       "--served-model-name tiny --log-level warning")
        serve.run(build_app(args), name="kvserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        kvserve = kvserve_trees()
        ray.shutdown()
        _, left = psutil.wait_procs(kvserve + kvserve_trees(), timeout=60)
        for proc in left:
            proc.kill()
    assert not left, f"kvserve processes outlived the cluster: {left}"


def complete(base: str, prompt, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(base + "/v1/completions", json=body, timeout=120)


# ---- no cluster needed -------------------------------------------------------------------------------------
def test_prefix_key_follows_the_first_prefix_chars():
    long = "x" * 300
    assert prefix_key(b'{"prompt": "%s a"}' % long.encode(), 256) == prefix_key(b'{"prompt": "%s b"}' % long.encode(),
                                                                                256)
    assert prefix_key(b'{"prompt": "a"}', 256) != prefix_key(b'{"prompt": "b"}', 256)
    chat = b'{"messages": [{"role": "user", "content": "hi"}]}'
    assert prefix_key(chat, 256) is not None and prefix_key(b"not json", 256) is None


def test_rendezvous_spreads_keys_and_moves_only_a_lost_replicas_keys():
    replicas = ["r-a", "r-b", "r-c"]
    owners = {k: rank_replicas(str(k), replicas)[0] for k in range(3000)}
    shares = [list(owners.values()).count(r) / len(owners) for r in replicas]
    assert all(0.28 < s < 0.39 for s in shares), shares
    survivors = {k: rank_replicas(str(k), ["r-a", "r-c"])[0] for k in owners}
    assert all(survivors[k] == owner for k, owner in owners.items() if owner != "r-b")


# ---- on the cluster ------------------------------------------------------------------------------------------
def test_requests_through_rays_proxy_are_answered_correctly(cluster, model_dir):
    from transformers import AutoTokenizer

    from test_parity import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[100 + 7 * i + j for j in range(20)] for i in range(3)]
    expected = hf_greedy(model_dir, prompts, [tokenizer.eos_token_id], max_tokens=6)
    for prompt, ids in zip(prompts, expected):
        response = complete(cluster, prompt, max_tokens=6)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        assert response.headers["x-kvserve-replica"]
    assert [m["id"] for m in httpx.get(cluster + "/v1/models", timeout=30).json()["data"]] == ["tiny"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", cluster + "/v1/chat/completions", json=body, timeout=120) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_events(streamed)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    bad = complete(cluster, "x", max_tokens=-1)  # kvserve's own 400 and error body come back unchanged
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_shared_prefix_requests_land_on_the_replica_that_has_the_prefix(cluster):
    first = {p: complete(cluster, p + "first") for p in PREFIXES}  # each prefix is now cached somewhere
    with ThreadPoolExecutor(8) as pool:
        later = list(pool.map(lambda job: (job[0], complete(cluster, job[0] + job[1])),
                              [(p, f"question {k}") for p in PREFIXES for k in range(3)]))
    for prefix, response in later:
        assert response.status_code == 200, response.text
        assert response.headers["x-kvserve-replica"] == first[prefix].headers["x-kvserve-replica"]
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # its blocks were there


def kvserve_children() -> dict[int, int]:
    """{replica actor pid: its kvserve child's pid}."""
    found = {}
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        if "server.ray_child" in " ".join(proc.info["cmdline"] or []):
            found[proc.info["ppid"]] = proc.info["pid"]
    return found


def kvserve_trees() -> list[psutil.Process]:
    """Every replica's kvserve child and its own children (the engine core)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "server.ray_child" in " ".join(proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.NoSuchProcess):
                found += [proc, *proc.children(recursive=True)]
    return found


def test_killing_one_replica_leaves_the_other_serving(cluster):
    import ray

    owner = complete(cluster, PREFIXES[0] + "who").headers["x-kvserve-replica"]
    actor = ray.get_actor(f"SERVE_REPLICA::kvserve#KvserveReplica#{owner}", namespace="serve")
    actor_pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    child = psutil.Process(kvserve_children()[actor_pid])
    ray.kill(actor, no_restart=True)  # the process dies at once, as in a crash; Ray starts a replacement
    gone, alive = psutil.wait_procs([child], timeout=60)
    assert not alive, "the killed replica's kvserve is still running"
    deadline = time.monotonic() + RECOVERY_TIMEOUT
    while (probe := complete(cluster, "probe")).status_code != 200:  # until the routers drop the dead replica
        assert probe.status_code == 503 and probe.json()["error"]["code"] == "engine_dead", probe.text
        assert time.monotonic() < deadline, "no replica answered after one was killed"
        time.sleep(0.1)
    for prefix in PREFIXES:  # the killed replica's prefixes included
        response = complete(cluster, prefix + "after")
        assert response.status_code == 200, response.text
        assert response.headers["x-kvserve-replica"] != owner
