"""The bench client against a stub server in its own process that streams as fast as it can: one client
process and several complete every request, and several merge into one result that reads like one process's
(the run's order, its arrival times, its concurrency cap). The figures (tokens/s) come from
benchmarks/bench_client_ceiling.py, not from here."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench import serve as bench_serve
from bench.datasets import random_requests
from bench.serve_client import ClientShare, RequestResult, ShareResult
from bench.serve_workers import make_shares, merge, split_concurrency
from bench.stub_server import running_stub


@pytest.fixture(scope="module")
def stub_url():
    with running_stub() as stub:
        yield stub.url


def run(url: str, tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    args = bench_serve.build_parser().parse_args(["--base-url", url, "--result-json", str(out), "--disable-tqdm",
                                                  "--num-warmups", "1", *extra])
    assert bench_serve.main(args) == 0
    return json.loads(out.read_text())


def check(result: dict, num: int, out_len: int) -> None:
    assert (result["completed"], result["failed"]) == (num, 0)
    assert result["output_lens"] == [out_len] * num and result["total_output_tokens"] == num * out_len
    assert all(len(itl) == out_len - 1 for itl in result["itls"])  # one chunk a token, every gap timed
    assert all(0 < ttft <= e2el for ttft, e2el in zip(result["ttfts"], result["latencies"]))
    assert result["output_throughput"] == pytest.approx(num * out_len / result["duration"])
    assert result["median_tpot_ms"] >= 0 and result["p99_itl_ms"] >= result["median_itl_ms"] >= 0


@pytest.mark.parametrize("workers", [1, 4])
def test_workers_complete_and_merge_in_the_runs_order(stub_url, tmp_path, workers, record_property):
    common = ["--num-prompts", "40", "--random-input-len", "8", "--random-output-len", "30",
              "--random-range-ratio", "0.5", "--num-workers", str(workers)]
    result = run(stub_url, tmp_path, f"all{workers}", *common)
    # Recorded, not asserted (a shared CI host's speed varies); benchmarks/bench_client_ceiling.py measures it.
    record_property("streamed_tokens_per_s", result["output_throughput"])
    lens = result["expected_output_lens"]
    assert result["completed"] == 40 and result["output_lens"] == lens and result["num_workers"] == workers
    # The stub reports usage.prompt_tokens = the ids sent: request i's result sits at i, whichever process sent it.
    sent = [len(r.prompt) for r in random_requests(40, 8, 30, 0.5, seed=0)]
    assert result["input_lens"] == sent
    assert result["max_concurrent_requests"] > workers  # all at once, from every process


def test_several_workers_keep_the_arrival_times_and_the_concurrency_cap(stub_url, tmp_path):
    paced = run(stub_url, tmp_path, "paced", "--num-prompts", "24", "--random-input-len", "8",
                "--random-output-len", "20", "--request-rate", "60", "--num-workers", "3")
    check(paced, 24, 20)
    drawn = bench_serve.arrival_offsets(24, 60.0, 1.0, np.random.default_rng(0))
    # Each process sends its requests at the run's drawn offsets from one common start.
    assert np.abs(np.asarray(paced["start_times"]) - drawn).max() < 0.25
    capped = run(stub_url, tmp_path, "capped", "--num-prompts", "30", "--random-input-len", "8",
                 "--random-output-len", "20", "--max-concurrency", "4", "--num-workers", "3")
    check(capped, 30, 20)
    assert 1 <= capped["max_concurrent_requests"] <= 4


def test_shares_split_requests_round_robin_and_the_cap_without_exceeding_it():
    whole = ClientShare("http://127.0.0.1:1", "/v1/completions", None, False, list(range(10)),
                        [{"i": i} for i in range(10)], list(range(10)), [5] * 10, [0.1 * i for i in range(10)],
                        10, 3.0)
    shares = make_shares(whole, num_workers=3, max_concurrency=5)
    assert [s.indices for s in shares] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [s.max_concurrency for s in shares] == [2, 2, 1] and sum(split_concurrency(5, 3)) == 5
    assert shares[1].offsets == pytest.approx([0.1, 0.4, 0.7]) and shares[2].bodies == [{"i": 2}, {"i": 5}, {"i": 8}]
    assert len(make_shares(whole, num_workers=8, max_concurrency=2)) == 2  # never more processes than the cap
    assert len(make_shares(whole, num_workers=1, max_concurrency=None)) == 1
    results = [ShareResult(s.indices, [RequestResult(i, 5) for i in s.indices], end_s=1.0 + k)
               for k, s in enumerate(shares)]
    merged, duration = merge(results, 10)
    assert [r.prompt_len for r in merged] == list(range(10)) and duration == 3.0


def test_prefix_repetition_dataset_through_several_workers(stub_url, tmp_path):
    result = run(stub_url, tmp_path, "prefix", "--dataset", "prefix_repetition", "--num-prompts", "12",
                 "--prefix-repetition-prefix-len", "20", "--prefix-repetition-suffix-len", "4",
                 "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-output-len", "6", "--num-workers", "2")
    check(result, 12, 6)
    assert result["input_lens"] == [24] * 12 and result["dataset"] == "prefix_repetition"
    assert result["prefix_repetition_num_prefixes"] == 3


def test_structured_fraction_constrains_exactly_that_share_of_bodies():
    from bench.serve import build_parser
    from bench.structured_mix import SCHEMA, constrain

    args = build_parser().parse_args(["--structured-fraction", "0.2", "--structured-form", "guided_json"])
    bodies = [{"prompt": [i], "max_tokens": 4} for i in range(50)]
    out = constrain(bodies, args.structured_fraction, 0, args.structured_form)
    assert [b for b in out if "guided_json" in b] and sum("guided_json" in b for b in out) == 10
    assert all(b["guided_json"] == SCHEMA for b in out if "guided_json" in b)
    assert all("guided_json" not in b for b in bodies)  # the originals are untouched
    assert constrain(bodies, 0.2, 0) == constrain(bodies, 0.2, 0)  # seeded
