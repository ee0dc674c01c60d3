"""benchmarks/online_pair.py (kvserve's server beside vLLM's: W-B json 0/20/100%, TTFT of long prompts alone)
and its report (bench/pair_report.py). The report (two systems' tables, ratios, targets) from made-up runs;
the script's whole path on the CPU with a tiny model (--smoke), and its vLLM phase through a stand-in for
vLLM's serve script (kvserve's server behind serve.sh's arguments and output). The figures themselves are
the GPU run's job."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.pair_report import (PairLoad, PairRun, constrained_indices, json_check, summarize, targets, ttft_table,
                               wb_table)
from bench import server_procs
from bench.structured_mix import constrain

REPO = Path(__file__).resolve().parents[1]
VALID = json.dumps({"id": 1, "title": "t", "status": "open", "tags": [], "owner": {"name": "n", "email": "a@b.cd"}})


def test_constrained_indices_are_the_ones_bench_serve_constrains():
    bodies = constrain([{"prompt": [i]} for i in range(50)], 0.2, seed=7)
    assert constrained_indices(50, 0.2, 7) == [i for i, b in enumerate(bodies) if "structured_outputs" in b]
    assert len(constrained_indices(50, 0.2, 7)) == 10 and constrained_indices(4, 1.0, 3) == [0, 1, 2, 3]


def test_json_check_counts_json_starts_and_whole_valid_documents():
    texts = [VALID + "free tokens after the EOS", ' {"id": 3, "tit', '{"id": -1}', "no json", "{ free"]
    assert json_check(texts, [0, 1, 2, 3]) == {"constrained": 4, "json_start": 3, "json_whole_valid": 1,
                                               "validated_by": "jsonschema", "free_json_start": 1}


def test_without_jsonschema_a_whole_document_needs_the_required_keys(monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # the H200 image has no jsonschema
    check = json_check([VALID, '{"id": 1}', '{"id": 1, "title": "t", "status": "open", "tags": [], "owner": 3}'],
                       [0, 1, 2])
    assert (check["json_whole_valid"], check["validated_by"]) == (2, "required keys")


def _result(ttfts: list[float], starts: list[float]) -> dict:
    base = dict(completed=len(ttfts), failed=0, duration=1.0, output_throughput=100.0, total_output_tokens=100,
                median_ttft_ms=1.0, p99_ttft_ms=2.0, median_tpot_ms=0.5, p99_tpot_ms=0.6, median_itl_ms=0.5,
                median_e2el_ms=3.0, max_concurrent_requests=1)
    return {**base, "ttfts": ttfts, "start_times": starts, "generated_texts": [VALID] * len(ttfts)}


def test_a_ttft_load_leaves_out_the_request_that_started_first():
    load = PairLoad("TTFT 8k", "ttft", 5, 8192, 8, max_concurrency=1)
    m = summarize(_result([0.05, 0.9, 0.04, 0.06, 0.03], [0.3, 0.0, 0.5, 0.7, 0.9]), load, seed=0)
    assert m["ttft_all_ms"] == pytest.approx([50, 40, 60, 30]) and m["ttft_min_ms"] == pytest.approx(30)
    assert m["ttft_p50_ms"] == pytest.approx(45)
    structured = summarize(_result([0.1] * 4, [0, 1, 2, 3]), PairLoad("W-B json 100%", "wb", 4, 8, 8, 1.0), 0)
    assert structured["json"] == {"constrained": 4, "json_start": 4, "json_whole_valid": 4,
                                  "validated_by": "jsonschema", "free_json_start": 0}


def _run(system: str, load: str, rep: int, tput: float, ttft: float = 10.0, failed: int = 0, **extra) -> PairRun:
    return PairRun(system, load, rep, metrics=dict(failed=failed, output_throughput=tput, median_ttft_ms=ttft,
                                                   p99_ttft_ms=2 * ttft, median_tpot_ms=1.0, **extra))


def test_tables_ratios_and_targets_from_medians_of_complete_runs():
    loads = [PairLoad("W-B json 0%", "wb", 256, 512, 128), PairLoad("W-B json 100%", "wb", 256, 512, 128, 1.0),
             PairLoad("TTFT 8k", "ttft", 5, 8192, 8, max_concurrency=1)]
    runs = [_run("kvserve", "W-B json 0%", 0, 1000), _run("kvserve", "W-B json 0%", 1, 1200),
            _run("kvserve", "W-B json 100%", 0, 950), _run("kvserve", "W-B json 100%", 1, 10, failed=3),
            _run("vLLM", "W-B json 0%", 0, 800), _run("vLLM", "W-B json 100%", 0, 1000),
            _run("kvserve", "TTFT 8k", 0, 1, ttft_p50_ms=40.0, ttft_min_ms=35.0),
            _run("vLLM", "TTFT 8k", 0, 1, ttft_p50_ms=50.0, ttft_min_ms=45.0)]
    figures: dict = {}
    wb = wb_table(runs, ["kvserve", "vLLM"], loads, figures)
    assert figures["W-B json 0%|kvserve"]["output_throughput"] == 1100  # median of both
    assert figures["W-B json 100%|kvserve"]["output_throughput"] == 950  # the run with failures left out
    assert figures["W-B json 100%|kvserve"]["vs_json0"] == pytest.approx(950 / 1100)
    assert "| W-B json 100% | kvserve/vLLM | 0.95x | | 1.00x | 1.00x | 1.00x | |" in wb
    tt = ttft_table(runs, ["kvserve", "vLLM"], loads, figures)
    assert tt[2] == "| TTFT 8k | 40.0 | 35.0 | 50.0 | 45.0 | 0.80x |"
    assert targets(figures, ["kvserve", "vLLM"], loads) == [
        "FAIL  W-B json 100%: kvserve at >= 0.90x its json 0% (0.86x)",
        "FAIL  W-B json 100%: kvserve out tok/s >= vLLM (0.95x)",
        "PASS  TTFT 8k: kvserve TTFT p50 <= vLLM (0.80x)"]


def test_each_repetition_is_paired_with_the_same_repetition_of_json_0():
    """The table's "vs json 0%" also gives the range of repetition-by-repetition ratios; a failed run pairs
    with nothing."""
    loads = [PairLoad("W-B json 0%", "wb", 256, 512, 128), PairLoad("W-B json 100%", "wb", 256, 512, 128, 1.0)]
    runs = [_run("kvserve", "W-B json 0%", k, t) for k, t in enumerate([1000, 1200, 800, 900])]
    runs += [_run("kvserve", "W-B json 100%", k, t, failed=k // 3) for k, t in enumerate([900, 1260, 720, 1])]
    figures: dict = {}
    wb = wb_table(runs, ["kvserve"], loads, figures)
    assert figures["W-B json 100%|kvserve"]["vs_json0_paired"] == pytest.approx([0.9, 1.05, 0.9])
    assert wb[3].startswith("| W-B json 100% | kvserve | 900 | 0.95x (0.90-1.05) |")
    assert wb[2].startswith("| W-B json 0% | kvserve | 950 | 1.00x |")


# ------------------------------------------------------------------------------------ the script, on the CPU

FAKE_VLLM = """#!/usr/bin/env bash
# A stand-in for .carry/peers/vllm_serve.sh (same arguments, same output): kvserve's server.
model="$1"; shift; port=8012; wait_s=60; more=()
while [ $# -gt 0 ]; do
    case "$1" in --port) port="$2"; shift 2 ;; --wait) wait_s="$2"; shift 2 ;; --) shift; more=("$@"); break ;;
                 *) shift ;; esac
done
log="/tmp/vllm-serve-$port.log"
PYTHONPATH="{repo}" nohup "{python}" -m server serve --model "$model" --port "$port" "${{more[@]}}" \\
    > "$log" 2>&1 < /dev/null &
pid=$!
echo "vLLM starting, PID $pid, log $log"
end=$((SECONDS + wait_s))
while [ "$SECONDS" -lt "$end" ]; do
    "{python}" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" \\
        "http://127.0.0.1:$port/ready" 2>/dev/null && echo "vLLM up, PID $pid" && exit 0
    sleep 0.5
done
exit 1
"""


def _smoke(tmp_path: Path, *extra: str, timeout: int = 150) -> tuple[dict, Path]:
    out, raw = tmp_path / "pair.json", tmp_path / "raw"
    done = subprocess.run([sys.executable, "benchmarks/online_pair.py", "--smoke", "--out", str(out), "--raw-dir",
                           str(raw), *extra], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), raw


def _check_system(record: dict, system: str, raw: Path) -> None:
    runs = [r for r in record["runs"] if r["system"] == system]
    assert [r["load"] for r in runs] == ["W-B json 0%", "W-B json 20%", "W-B json 100%", "TTFT 64", "TTFT 200"]
    assert all(not r["error"] and r["metrics"]["failed"] == 0 for r in runs)
    by_load = {r["load"]: r["metrics"] for r in runs}
    assert "json" not in by_load["W-B json 0%"]
    some = by_load["W-B json 20%"]["json"]
    assert (some["constrained"], some["json_start"]) == (2, 2)  # round(0.2 * 8) constrained, both JSON
    # ... and the report's constrained ones are the ones bench serve chose: exactly they open the schema's
    # record. (A free output of the random model may open with "{" by chance: its BPE learnt JSON.)
    texts = json.loads((raw / f"{system}-W-B_json_20pct-0.json").read_text())["generated_texts"]
    seed = next(r["seed"] for r in runs if r["load"] == "W-B json 20%")
    assert {i for i, t in enumerate(texts) if t.startswith('{"id":')} == set(constrained_indices(8, 0.2, seed))
    every = by_load["W-B json 100%"]["json"]
    assert every["constrained"] == 8 and every["json_start"] == 8  # the constraint was honoured
    assert len(by_load["TTFT 200"]["ttft_all_ms"]) == 2  # 3 requests, the first one the warm-up
    assert record["figures"]["W-B json 0%|" + system]["vs_json0"] == 1.0
    cores = by_load["W-B json 100%"]["cpu_cores"]  # the server's processes by role, over the load
    assert cores.get("engine core", 0) > 0.05 and all(c >= 0.01 for c in cores.values())
    engine = {load: by_load[load]["engine"] for load in ("W-B json 0%", "W-B json 100%")}  # kvserve's counters
    if system == "kvserve":
        assert engine["W-B json 0%"]["masked_steps"] == 0 < engine["W-B json 100%"]["masked_steps"]
        assert engine["W-B json 100%"]["steps"] >= engine["W-B json 100%"]["masked_steps"]
        assert 0 < engine["W-B json 100%"]["busy_share"] <= 1.05
        sections = engine["W-B json 100%"]["section_ms_per_step"]  # the laps of each step add up to its busy time
        in_steps = sum(v for k, v in sections.items() if k != "core loop")
        assert in_steps == pytest.approx(engine["W-B json 100%"]["busy_ms_per_step"], rel=0.05, abs=0.01)
        assert sections["mask wait"] >= engine["W-B json 100%"]["mask_wait_ms_per_masked_step"] * (
            engine["W-B json 100%"]["masked_steps"] / engine["W-B json 100%"]["steps"]) > 0


@pytest.mark.slow
def test_smoke_runs_both_phases_on_the_cpu_the_vllm_one_through_the_serve_script(tmp_path):
    """One run, as on the GPU host: kvserve's phase, then vLLM's through its serve script (a stand-in that
    starts kvserve's server behind serve.sh's arguments and output); both systems' rows and their ratios."""
    script = tmp_path / "fake_vllm_serve.sh"
    script.write_text(FAKE_VLLM.format(repo=REPO, python=sys.executable))
    record, raw = _smoke(tmp_path, "--vllm", "--vllm-serve-script", str(script), timeout=240)
    assert record["phases"] == {"kvserve": "measured", "vLLM": "measured"} and record["smoke"]
    for system in ("kvserve", "vLLM"):
        _check_system(record, system, raw)
        assert (raw / f"{system}-serve.log").stat().st_size > 0 and len(list(raw.glob(f"{system}-*.json"))) == 6
    copied = (raw / "vLLM-serve.log").read_bytes()
    for log in Path("/tmp").glob("vllm-serve-*.log"):  # where serve.sh (and the stand-in) writes it
        if log.read_bytes() == copied:
            log.unlink()
    assert any(line.startswith("| W-B json 100% | kvserve |") for line in record["table"])
    assert any(line.startswith("| W-B json 100% | kvserve/vLLM |") for line in record["table"])
    assert record["figures"]["TTFT 64|ttft"]["vLLM"]["p50_ms"] > 0


def test_a_failed_run_shows_the_server_logs_last_traceback():
    """vLLM's 500s had an empty message: the cause is only in its log, so the log's last traceback is shown."""
    log = "INFO start\nTraceback (most recent call last):\n  old\nKeyError: 1\nINFO ok\n" \
          "Traceback (most recent call last):\n  File \"x.py\"\nModuleNotFoundError: No module named 'lm'\nINFO after"
    shown = server_procs.last_traceback(log, lines=3)
    assert shown.splitlines() == ["Traceback (most recent call last):", '  File "x.py"',
                                  "ModuleNotFoundError: No module named 'lm'"]
    assert server_procs.last_traceback("a\nb\nc", lines=2) == "b\nc"  # no traceback: the tail


def test_a_run_with_a_few_failed_requests_counts_and_the_table_says_so():
    """vLLM failed 5 of 256 constrained requests in one run: its throughput still counts (over the rest),
    flagged; a run where more than 5% failed does not."""
    loads = [PairLoad("W-B json 100%", "wb", 256, 512, 128, 1.0)]
    runs = [_run("vLLM", "W-B json 100%", 0, 1000, completed=251, failed=5),
            _run("vLLM", "W-B json 100%", 1, 10, completed=200, failed=56)]
    figures: dict = {}
    table = wb_table(runs, ["vLLM"], loads, figures)
    assert figures["W-B json 100%|vLLM"]["output_throughput"] == 1000
    assert table[-1].endswith("| 61 failed |")


def test_cpu_by_role_counts_a_busy_child_under_its_title_and_leaves_idle_roles_out():
    """bench/proc_cpu.py: a descendant spinning for 0.6 s of a 1 s window, its command line carrying a front
    end's title, shows as that role's busy cores."""
    from bench.proc_cpu import cores_between, cpu_by_role

    spin = "import time  # kvserve::api-server-0\nt = time.time()\nwhile time.time() - t < 0.6: pass\ntime.sleep(5)"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        before, start = cpu_by_role(os.getpid()), time.monotonic()
        time.sleep(1.0)
        cores = cores_between(before, cpu_by_role(os.getpid()), time.monotonic() - start)
    finally:
        child.kill()
        child.wait()
    assert 0.2 < cores["front ends"] <= 1.05 and "grammar processes" not in cores


def test_wb_is_sent_greedy_as_defined_unless_asked_otherwise(monkeypatch, tmp_path):
    """W-B is greedy (bench/workloads.py, vLLM's vllm_bench.py): every request the pair sends carries its load's
    temperature, 0 unless --temperature says otherwise (earlier sessions sent none: OpenAI's default of 1)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import online_pair

    sent = []
    monkeypatch.setattr(server_procs, "run_bench_serve", lambda cmd, out, timeout: sent.append(cmd) or {})
    monkeypatch.setattr(online_pair, "summarize", lambda result, load, seed: {})
    for temperature in (None, 0.7):
        argv = [] if temperature is None else ["--temperature", str(temperature)]
        args = online_pair.parse_args(argv)
        _, loads = online_pair.gpu_loads(args.repeat, args.client_workers, args.temperature)
        online_pair.bench_serve("http://x", loads[0], 1, "structured_outputs", tmp_path / "r.json", 30)
    bodies = [json.loads(cmd[cmd.index("--extra-body") + 1]) for cmd in sent]
    assert bodies == [{"temperature": 0.0}, {"temperature": 0.7}]
