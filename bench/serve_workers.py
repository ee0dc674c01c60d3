"""`kvserve bench serve --num-workers N`: the requests spread over N client processes, merged into one result.

One Python process parses a bounded number of SSE chunks per second (docs/benchmarking.md, "The client's
ceiling"); a server that streams faster would be measured at the client's speed. So request i goes to
process i mod N, with the arrival offset drawn for the whole run, and every process starts on one clock: the
parent waits until each has imported its libraries and opened its loop, then sets a common start on the
system-wide monotonic clock. --max-concurrency C is split over the processes (C // N each, the remainder to
the first ones), so no more than C are in flight; N is capped at C and at the number of requests. Results
come back in the order the requests were drawn, so the merged run reads like a one-process run.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from typing import Callable

from bench.serve_client import ClientShare, RequestResult, ShareResult, run_async, send_share

START_MARGIN_S = 0.1  # from the parent's "go" to the common start: every process is awake by then
READY_TIMEOUT_S = 120.0  # for a client process to import aiohttp and report ready (a loaded host is slow)


@dataclass
class WorkerReport:
    """A client process to the parent: ready, done (with its results) or failed (with the error)."""
    worker: int
    kind: str  # "ready" | "done" | "failed"
    result: ShareResult | None = None
    error: str = ""


def split_concurrency(total: int, n: int) -> list[int]:
    return [total // n + (k < total % n) for k in range(n)]


def make_shares(template: ClientShare, num_workers: int, max_concurrency: int | None) -> list[ClientShare]:
    """Request i to share i mod N; `template` holds the whole run (its max_concurrency is ignored)."""
    total = len(template.indices)
    n = max(1, min(num_workers, total, max_concurrency or total))
    caps = split_concurrency(max_concurrency or total, n)
    shares = []
    for k in range(n):
        pick = range(k, total, n)
        shares.append(ClientShare(
            template.base_url, template.endpoint, template.api_key, template.trust_env,
            [template.indices[i] for i in pick], [template.bodies[i] for i in pick],
            [template.prompt_lens[i] for i in pick], [template.expected_output_lens[i] for i in pick],
            [template.offsets[i] for i in pick], min(caps[k], len(pick)), template.request_timeout))
    return shares


def merge(shares: list[ShareResult], total: int) -> tuple[list[RequestResult], float]:
    """(every request's result in the run's order, the run's duration: until the last process finished)."""
    results: list[RequestResult | None] = [None] * total
    for share in shares:
        for i, r in zip(share.indices, share.results):
            results[i] = r
    assert all(r is not None for r in results), "a request's result is missing"
    return results, max(s.end_s for s in shares)


def run_shares(shares: list[ClientShare], on_done: Callable[[int], None]) -> tuple[list[RequestResult], float]:
    """Run the shares (in this process when there is one) and merge; on_done(k) reports k more finished."""
    total = sum(len(s.indices) for s in shares)
    if len(shares) == 1:
        result = run_async(send_share(shares[0], time.perf_counter(), lambda: on_done(1)))
        return merge([result], total)
    return merge(_run_processes(shares, on_done), total)


def _client_process(worker: int, share: ClientShare, start, go, done, out) -> None:
    """One client process: report ready, wait for the go, run the share from the common start, report."""
    try:
        importlib.import_module("aiohttp")  # imported before the start, not during it
        out.put(WorkerReport(worker, "ready"))
        go.wait()
        t0 = time.perf_counter() + (start.value - time.monotonic())

        def finished() -> None:
            with done.get_lock():
                done.value += 1

        out.put(WorkerReport(worker, "done", result=run_async(send_share(share, t0, finished))))
    except BaseException as e:  # noqa: BLE001 - the parent must hear of any failure, not wait for it
        out.put(WorkerReport(worker, "failed", error=f"{type(e).__name__}: {e}"))


def _run_processes(shares: list[ClientShare], on_done: Callable[[int], None]) -> list[ShareResult]:
    ctx = mp.get_context("spawn")  # no fork of a parent that may hold tokenizer threads
    start, go, done, out = ctx.Value("d", 0.0), ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(k, share, start, go, done, out), daemon=True,
                         name=f"kvserve-bench-client-{k}") for k, share in enumerate(shares)]
    for p in procs:
        p.start()
    try:
        _wait_reports(out, procs, "ready", READY_TIMEOUT_S, lambda: None)
        start.value = time.monotonic() + START_MARGIN_S
        go.set()
        reported = [0]

        def progress() -> None:
            now = done.value
            on_done(now - reported[0])
            reported[0] = now

        reports = _wait_reports(out, procs, "done", None, progress)
        progress()
        return [r.result for r in reports]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def _wait_reports(out, procs, kind: str, timeout: float | None, poll: Callable[[], None]) -> list[WorkerReport]:
    """One `kind` report from every process; RuntimeError if one fails, dies silently or times out."""
    reports: dict[int, WorkerReport] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(reports) < len(procs):
        poll()
        try:
            report = out.get(timeout=0.2)
        except queue.Empty:
            dead = [p.name for k, p in enumerate(procs) if k not in reports and not p.is_alive()]
            late = deadline is not None and time.monotonic() > deadline
            if not (dead or late):
                continue
            try:  # a process that exited right after its report: the report is in the pipe
                report = out.get(timeout=1.0)
            except queue.Empty:
                raise RuntimeError(f"client process(es) {dead or 'all'} did not report {kind}") from None
        if report.kind == "failed":
            raise RuntimeError(f"client process {report.worker} failed: {report.error}")
        reports[report.worker] = report
    return [reports[k] for k in range(len(procs))]
