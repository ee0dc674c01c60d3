"""The report of benchmarks/online_pair.py (kvserve's server beside vLLM's: W-B with 0/20/100% of requests
under a JSON schema, issue 15; TTFT of one long prompt alone, issue 19). Pure functions of `bench serve`
result files and of the runs' summaries, so they are tested without servers.

Per run: bench serve's summary figures; for a load with constrained requests, how many of their outputs
start as JSON and how many hold a whole document that validates (a server that dropped the constraint
would be timed on free text: a random model starts with `{` about once in 150,000 tokens); for a TTFT
load, its first request is the warm-up (a fresh prompt, so no cache hit) and the rest give TTFT p50 and min.
Per load and system: the median over repetitions in which at most MAX_FAILED_SHARE of the requests failed
(vLLM 0.24.0 failed 0.4-2% of its constrained requests on the H200, its throughput counted over the rest);
the constrained-outputs cell counts the failures.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

from bench.structured_mix import SCHEMA, constrain

SUMMARY_KEYS = ("completed", "failed", "duration", "output_throughput", "total_output_tokens", "median_ttft_ms",
                "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms",
                "max_concurrent_requests")


@dataclass
class PairLoad:
    name: str
    kind: str  # "wb": throughput at once, "ttft": one request at a time
    num_prompts: int
    input_len: int
    output_len: int
    structured_fraction: float = 0.0
    max_concurrency: int | None = None
    workers: int = 1
    repeats: int = 1
    prompt_vocab: int = 150_000  # prompt ids from [0, prompt_vocab): below Qwen2.5's EOS (151,643)
    temperature: float = 0.0  # sent with every request: W-B is greedy (bench/workloads.py, vLLM's vllm_bench.py)


@dataclass
class PairRun:
    system: str
    load: str
    repeat: int
    seed: int = 0
    metrics: dict = field(default_factory=dict)
    error: str = ""


def _schema_check():
    """jsonschema's validation of SCHEMA when it is installed (the test extras; the H200 image may lack it),
    else its required keys present at the top level: (check(doc) -> bool, what it checks)."""
    try:
        import jsonschema
    except ImportError:
        return (lambda doc: isinstance(doc, dict) and all(k in doc for k in SCHEMA["required"])), "required keys"
    return (lambda doc: jsonschema.Draft202012Validator(SCHEMA).is_valid(doc)), "jsonschema"


def json_check(texts: list[str], constrained: list[int]) -> dict:
    """How many constrained outputs start as JSON / hold a whole valid document first (the rest of a fixed
    length output runs free after the document's EOS), and how many free ones start with `{`."""
    valid_doc, how = _schema_check()
    chosen = set(constrained)
    starts = [i for i in chosen if texts[i].lstrip().startswith("{")]
    valid = 0
    for i in starts:
        try:
            doc, _ = json.JSONDecoder().raw_decode(texts[i].lstrip())
        except ValueError:
            continue
        valid += bool(valid_doc(doc))
    free = [i for i in range(len(texts)) if i not in chosen]
    return {"constrained": len(chosen), "json_start": len(starts), "json_whole_valid": valid, "validated_by": how,
            "free_json_start": sum(texts[i].lstrip().startswith("{") for i in free)}


def constrained_indices(num: int, fraction: float, seed: int) -> list[int]:
    """The requests bench serve constrained (bench/structured_mix.py's seeded choice, run again)."""
    marked = constrain([{} for _ in range(num)], fraction, seed)
    return [i for i, body in enumerate(marked) if body]


def summarize(result: dict, load: PairLoad, seed: int) -> dict:
    """One run's figures from its bench serve result file."""
    metrics = {k: result[k] for k in SUMMARY_KEYS}
    if result.get("engine"):  # kvserve's engine counters over the timed window (bench/engine_counters.py)
        metrics["engine"] = result["engine"]
    if load.structured_fraction:
        metrics["json"] = json_check(result["generated_texts"],
                                     constrained_indices(len(result["generated_texts"]), load.structured_fraction,
                                                         seed))
    if load.kind == "ttft":
        ttfts = [t for t, s in sorted(zip(result["ttfts"], result["start_times"]), key=lambda p: p[1])][1:]
        ok = [1000 * t for t in ttfts if t and t > 0]
        metrics.update(ttft_p50_ms=statistics.median(ok) if ok else None, ttft_min_ms=min(ok) if ok else None,
                       ttft_all_ms=ok)
    return metrics


MAX_FAILED_SHARE = 0.05


def counts(metrics: dict | None) -> bool:
    """A run's figures count when at most MAX_FAILED_SHARE of its requests failed."""
    if not metrics:
        return False
    failed = metrics["failed"]
    return failed <= MAX_FAILED_SHARE * (metrics.get("completed", 0) + failed)


def median_of(runs: list[PairRun], system: str, load: str, key: str) -> float | None:
    values = [r.metrics[key] for r in runs if r.system == system and r.load == load and counts(r.metrics)
              and r.metrics.get(key) is not None]
    return statistics.median(values) if values else None


def paired_ratios(runs: list[PairRun], system: str, load: str, base: str) -> list[float]:
    """Each repetition's throughput over the same repetition's `base` load (run next to it: the loads alternate),
    where both completed: how far the median ratio's repetitions spread (json 0% alone swings ~20% between
    repetitions of one server on the H100 hosts, docs/benchmarks.md, twelfth session)."""
    def by_rep(name: str) -> dict[int, float]:
        return {r.repeat: r.metrics["output_throughput"] for r in runs
                if r.system == system and r.load == name and counts(r.metrics)}

    mine, ref = by_rep(load), by_rep(base)
    return [mine[k] / ref[k] for k in sorted(mine) if ref.get(k)]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _json_cell(runs: list[PairRun], system: str, load: str) -> str:
    mine = [r.metrics for r in runs if r.system == system and r.load == load and r.metrics]
    checks = [m["json"] for m in mine if "json" in m]
    failed = sum(m["failed"] for m in mine)
    cell = f"{failed} failed" if failed else ""
    if not checks:
        return cell
    total = lambda k: sum(c[k] for c in checks)  # noqa: E731
    return f"{total('json_start')}/{total('constrained')} JSON, {total('json_whole_valid')} whole" + (
        f", {cell}" if cell else "")


def wb_table(runs: list[PairRun], systems: list[str], loads: list[PairLoad], figures: dict) -> list[str]:
    """Markdown: one row per load and system (medians), its throughput relative to the same system's 0%
    load (the ratio of medians, and in brackets the range of the repetitions' paired ratios), then kvserve /
    other system."""
    base = next((ld.name for ld in loads if ld.kind == "wb" and not ld.structured_fraction), None)
    lines = ["| load | system | out tok/s | vs json 0% | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "constrained outputs |",
             "|---|---|---|---|---|---|---|---|"]
    for load in (ld for ld in loads if ld.kind == "wb"):
        for s in systems:
            tput = median_of(runs, s, load.name, "output_throughput")
            rel = _ratio(tput, median_of(runs, s, base, "output_throughput")) if base else None
            paired = paired_ratios(runs, s, load.name, base) if base else []
            figures[f"{load.name}|{s}"] = {"output_throughput": tput, "vs_json0": rel, "vs_json0_paired": paired, **{
                k: median_of(runs, s, load.name, k) for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")}}
            f = figures[f"{load.name}|{s}"]
            spread = f" ({min(paired):.2f}-{max(paired):.2f})" if len(paired) > 1 and load.name != base else ""
            lines.append(f"| {load.name} | {s} | {_fmt(tput, ',.0f')} | {_fmt(rel, '.2f')}x{spread} | "
                         f"{_fmt(f['median_ttft_ms'], '.1f')} | {_fmt(f['p99_ttft_ms'], '.1f')} | "
                         f"{_fmt(f['median_tpot_ms'], '.2f')} | {_json_cell(runs, s, load.name)} |")
        for other in systems[1:]:
            a, b = figures[f"{load.name}|{systems[0]}"], figures[f"{load.name}|{other}"]
            lines.append(f"| {load.name} | {systems[0]}/{other} | "
                         f"{_fmt(_ratio(a['output_throughput'], b['output_throughput']), '.2f')}x | | "
                         f"{_fmt(_ratio(a['median_ttft_ms'], b['median_ttft_ms']), '.2f')}x | "
                         f"{_fmt(_ratio(a['p99_ttft_ms'], b['p99_ttft_ms']), '.2f')}x | "
                         f"{_fmt(_ratio(a['median_tpot_ms'], b['median_tpot_ms']), '.2f')}x | |")
    return lines


def ttft_table(runs: list[PairRun], systems: list[str], loads: list[PairLoad], figures: dict) -> list[str]:
    """Markdown: TTFT p50 and min per system, and kvserve / other system (below 1: kvserve is faster)."""
    head = "| prompt |" + "".join(f" {s} TTFT p50 ms | {s} min ms |" for s in systems)
    head += "".join(f" {systems[0]}/{s} p50 |" for s in systems[1:])
    lines = [head, "|---" * (1 + 2 * len(systems) + len(systems) - 1) + "|"]
    for load in (ld for ld in loads if ld.kind == "ttft"):
        vals = {s: (median_of(runs, s, load.name, "ttft_p50_ms"), median_of(runs, s, load.name, "ttft_min_ms"))
                for s in systems}
        figures[f"{load.name}|ttft"] = {s: {"p50_ms": p, "min_ms": m} for s, (p, m) in vals.items()}
        row = f"| {load.name} |" + "".join(f" {_fmt(p, '.1f')} | {_fmt(m, '.1f')} |" for p, m in vals.values())
        row += "".join(f" {_fmt(_ratio(vals[systems[0]][0], vals[s][0]), '.2f')}x |" for s in systems[1:])
        lines.append(row)
    return lines


def targets(figures: dict, systems: list[str], loads: list[PairLoad]) -> list[str]:
    """Issue 15: json 100% within 10% of the same server's 0%, and at or above vLLM at each structured mix;
    issue 19: TTFT of each long prompt alone at or below vLLM's."""
    kv, checks = systems[0], []

    def check(what: str, ok: bool | None) -> None:
        checks.append(f"{'PASS' if ok else 'FAIL' if ok is not None else 'n/a '}  {what}")

    for load in (ld for ld in loads if ld.kind == "wb" and ld.structured_fraction):
        mine = figures.get(f"{load.name}|{kv}", {})
        if load.structured_fraction == 1.0:
            rel = mine.get("vs_json0")
            check(f"{load.name}: {kv} at >= 0.90x its json 0% ({_fmt(rel, '.2f')}x)",
                  None if rel is None else rel >= 0.9)
        for other in systems[1:]:
            r = _ratio(mine.get("output_throughput"), figures.get(f"{load.name}|{other}", {}).get("output_throughput"))
            check(f"{load.name}: {kv} out tok/s >= {other} ({_fmt(r, '.2f')}x)", None if r is None else r >= 1.0)
    for load in (ld for ld in loads if ld.kind == "ttft"):
        per = figures.get(f"{load.name}|ttft", {})
        for other in systems[1:]:
            r = _ratio(per.get(kv, {}).get("p50_ms"), per.get(other, {}).get("p50_ms"))
            check(f"{load.name}: {kv} TTFT p50 <= {other} ({_fmt(r, '.2f')}x)", None if r is None else r <= 1.0)
    return checks
