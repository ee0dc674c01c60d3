"""What a constrained step's grammar work costs the engine thread, with the matchers in the engine's process
(engine/structured.py StructuredOutputs) and in the grammar process (engine/grammar_link.py GrammarLink): the
engine's own classes, driven as the engine drives them, with the engine's other Python (detokenization,
scheduling, staging) stood in for by a busy loop of --window-ms between sending a step's tokens and sampling:

- in-process: every matcher consumes its token in the engine thread, then the batch fill runs in the mask
  thread (start_fill) while the engine thread is busy;
- grammar process: accept() only records the token; start_fill sends the step (tokens, rows) to the worker,
  which consumes, fills the shared bitmask and answers.

Per step it reports the engine thread's work (consume + start), the window, and its wait for the masks
afterwards; "step longer by" is work + wait. Rows walk bench/structured_mix.py's record schema along one
document on the byte-level BPE of the H200 pair (151,936 ids), each row at a different position. Both forms'
last masks are compared. Prints a table, writes JSON.

    python benchmarks/grammar_process.py --batch 256 --steps 40 --out grammar_process.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

EOS = 151643
DOC = {"id": 12345, "title": "A fairly long title for the record that goes on for a while", "status": "pending",
       "tags": ["alpha", "beta", "gamma", "delta", "epsilon"],
       "owner": {"name": "Some Person With A Name", "email": "some.one@example.com"}, "score": 3.25}


def make(form: str, tok, vocab: int, batch: int, spin_ms: float | None = None):
    """The form's structured-outputs object, as the engine makes it."""
    from engine.grammar import GrammarLimits
    from engine.grammar_link import GrammarLink
    from engine.structured import StructuredOutputs

    if form == "in-process":
        return StructuredOutputs(tok, vocab, [EOS], GrammarLimits())
    link = GrammarLink(tok, vocab, [EOS], GrammarLimits(), "auto", batch,
                       spin_s=None if spin_ms is None else spin_ms / 1e3)
    error = link.wait_ready()
    if error is not None:
        raise SystemExit(f"the grammar process did not start: {error}")
    return link


def staggered_rows(structured, doc: list[int], batch: int, steps: int) -> list:
    """`batch` requests (only .grammar), row i after the document's first i % (len(doc) - steps) tokens."""
    from bench.structured_mix import SCHEMA
    from engine.request import StructuredOutput

    compiled = structured.compile(StructuredOutput(json=json.dumps(SCHEMA)))
    compiled.result(timeout=120)
    rows = [SimpleNamespace(grammar=structured.new_grammar(compiled)) for _ in range(batch)]
    for i, row in enumerate(rows):
        for t in doc[:i % (len(doc) - steps)]:
            assert row.grammar.accept(t)
    structured.fill(rows)  # the grammar process consumes what was recorded with its first step
    return rows


def busy(ms: float) -> None:
    """The engine's own Python between a step's start_fill and its sampling, as a loop that holds the GIL."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def run(form: str, args, tok, vocab: int, doc: list[int]) -> tuple[list[dict], object]:
    structured = make(form, tok, vocab, args.batch, args.spin_ms)
    if hasattr(structured, "switch_interval_s"):
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    try:
        rows = staggered_rows(structured, doc, args.batch, args.steps)
        out, masks = [], None
        for k in range(args.steps):
            tokens = [doc[i % (len(doc) - args.steps) + k] for i in range(args.batch)]
            t0 = time.perf_counter()
            refused = [i for i, (row, t) in enumerate(zip(rows, tokens)) if not row.grammar.accept(t)]
            pending = structured.start_fill(rows)
            t1 = time.perf_counter()
            busy(args.window_ms)
            t2 = time.perf_counter()
            masks = pending.result()
            t3 = time.perf_counter()
            assert not refused
            out.append({"work_ms": (t1 - t0) * 1e3, "window_ms": (t2 - t1) * 1e3, "wait_ms": (t3 - t2) * 1e3})
        return out, masks.bitmask.clone()
    finally:
        sys.setswitchinterval(0.005)
        structured.shutdown()


def summarize(name: str, steps: list[dict]) -> dict:
    """Medians over the steps after the first two (warm-up)."""
    rows = steps[2:]
    med = {k: statistics.median(r[k] for r in rows) for k in ("work_ms", "window_ms", "wait_ms")}
    med["beyond_window_ms"] = med["work_ms"] + med["wait_ms"]
    print(f"{name:16s} engine thread: work {med['work_ms']:6.3f} ms  window {med['window_ms']:6.3f} ms  "
          f"wait {med['wait_ms']:6.3f} ms  -> step longer by {med['beyond_window_ms']:6.3f} ms", flush=True)
    return {**med, "steps": steps}


def main() -> int:
    from benchmarks.grammar_engines import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--window-ms", type=float, default=2.5, help="the engine's Python between tokens and sampling")
    p.add_argument("--switch-interval-ms", type=float, default=0.2, help="in-process: the GIL switch interval")
    p.add_argument("--spin-ms", type=float, default=None,
                   help="grammar process: how long the engine polls for the answer before it blocks (default: "
                        "the link's, by host cores)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    tok, vocab = load_tokenizer("wb-bpe")
    doc = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    if len(doc) <= args.steps:
        raise SystemExit(f"--steps must stay below the document's {len(doc)} tokens")
    (local, local_mask), (remote, remote_mask) = (run(f, args, tok, vocab, doc) for f in ("in-process", "process"))
    same = bool((local_mask == remote_mask).all())  # the same rows walked the same tokens: the same masks
    print(f"last step's masks equal in both forms: {same}")
    result = {"batch": args.batch, "window_ms": args.window_ms, "cores": mp.cpu_count(), "masks_equal": same,
              "thread": summarize("in-process", local), "process": summarize("grammar process", remote)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
