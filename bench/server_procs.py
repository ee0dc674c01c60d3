"""Servers started and stopped by a benchmark: kvserve's `kvserve serve` and vLLM's OpenAI server, each a
process tree this code started, waited for on an HTTP readiness URL under a timeout, and stopped by its own
ids (SIGTERM to the tree, then SIGKILL to whatever of it is left), so that one hung server cannot hold the
GPU, or the device budget, past its phase.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Clock:
    """Timestamps for the log and the one deadline every phase's timeout is cut to."""
    deadline_s: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.start)

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.start:6.1f}s] {msg}", flush=True)


def kvserve_env() -> dict:
    """This environment with the checkout first on PYTHONPATH: kvserve runs from it without an install."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_bench_serve(args: list[str], out: Path, timeout_s: float) -> dict:
    """`python -m bench.serve ARGS --result-json OUT` in its own process group (killed, clients and all, at
    timeout_s); the result JSON it wrote. RuntimeError if it failed."""
    cmd = [sys.executable, "-m", "bench.serve", *args, "--result-json", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=kvserve_env(), start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench serve failed ({proc.returncode}): {stderr[-1500:]}")
    return json.loads(out.read_text())


@dataclass
class ServerProc:
    name: str
    pid: int  # the server's main process (for vLLM through its script: not our child)
    base_url: str
    log: Path
    popen: subprocess.Popen | None = None  # when it is our child


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def wait_ready(proc: ServerProc, path: str, timeout_s: float) -> None:
    """Until GET base_url+path answers 200; RuntimeError (with the log's tail) if it dies or times out."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if answers(proc.base_url + path):
            return
        if not alive(proc.pid):
            raise RuntimeError(f"{proc.name} exited while starting; end of {proc.log}:\n{tail(proc.log)}")
        time.sleep(0.5)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s:.0f} s; end of {proc.log}:\n{tail(proc.log)}")


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop(proc: ServerProc, grace_s: float = 30.0) -> None:
    """SIGTERM the server and its descendants, wait up to grace_s, SIGKILL the survivors; wait for them."""
    tree = [proc.pid] + descendants(proc.pid)
    for pid in tree:
        _signal(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while any(alive(p) for p in tree) and time.monotonic() < end:
        if proc.popen is not None:
            proc.popen.poll()  # reap our child, or it stays a zombie
        time.sleep(0.2)
    for pid in tree + descendants(proc.pid):
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    if proc.popen is not None:
        proc.popen.wait(timeout=10)
    end = time.monotonic() + 10
    while any(alive(p) for p in tree) and time.monotonic() < end:
        time.sleep(0.1)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start_kvserve(model_dir: Path, args: list[str], log: Path, timeout_s: float) -> ServerProc:
    """`python -m server serve` from this checkout, ready when /ready answers (every front end up)."""
    port = free_port()
    env = {**kvserve_env(), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "server", "serve", "--model", str(model_dir), "--port", str(port), *args]
    with open(log, "w") as out:
        popen = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc = ServerProc("kvserve serve", popen.pid, f"http://127.0.0.1:{port}", log, popen)
    _started(proc, "/ready", timeout_s, " ".join(cmd))
    return proc


def start_vllm_script(script: Path, model_dir: Path, args: list[str], timeout_s: float) -> ServerProc:
    """vLLM through shared/peers/vllm's serve.sh (one front end): it starts the server in the background,
    waits for /health and prints the PID."""
    if not script.is_file():
        raise RuntimeError(f"{script} is missing: run shared/peers/vllm/fetch --server and stage its folders")
    port = free_port()
    cmd = ["bash", str(script), str(model_dir), "--port", str(port), "--wait", str(int(timeout_s))]
    if args:
        cmd += ["--", *args]
    print(f"    $ {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 30)
    found = re.search(r"PID (\d+)", done.stdout)
    log = Path(f"/tmp/vllm-serve-{port}.log")
    if found is None:
        raise RuntimeError(f"vllm_serve.sh printed no PID:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    proc = ServerProc("vLLM serve", int(found.group(1)), f"http://127.0.0.1:{port}", log)
    if done.returncode != 0:
        stop(proc)
        raise RuntimeError(f"vllm_serve.sh failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return proc


def start_vllm_cli(site: str, model_dir: Path, args: list[str], log: Path, timeout_s: float) -> ServerProc:
    """`vllm serve` (vllm.entrypoints.cli.main), the command that honours --api-server-count, with the
    environment serve.sh gives the api_server."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": site, "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--port", str(port), *args]
    with open(log, "w") as out:
        # cwd /tmp: from a checkout, `python3 -m` would put kvserve's packages first on vLLM's path
        popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=tempfile.gettempdir())
    proc = ServerProc("vllm serve", popen.pid, f"http://127.0.0.1:{port}", log, popen)
    _started(proc, "/health", timeout_s, f"PYTHONPATH={site} " + " ".join(cmd))
    return proc


def _started(proc: ServerProc, path: str, timeout_s: float, command: str) -> None:
    print(f"    $ {command}", flush=True)
    try:
        wait_ready(proc, path, timeout_s)
    except RuntimeError:
        stop(proc)
        raise


def last_traceback(log: str, lines: int = 40) -> str:
    """The server log's last traceback (a failed run's cause: its HTTP error body may be empty), or its tail."""
    at = log.rfind("Traceback (most recent call last)")
    text = log[at:] if at >= 0 else log
    return "\n".join(text.splitlines()[:lines] if at >= 0 else text.splitlines()[-lines:])
