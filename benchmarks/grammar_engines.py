"""xgrammar against llguidance on our tokenizer: grammar compile time and per-token mask fill.

    python benchmarks/grammar_engines.py --out grammar_engines.json

For each schema (and a regex and a choice), on the SmolLM2 tokenizer (the embedded model's; the tests' tiny
random models carry the same one) or, with --tokenizer wb-bpe, the H200 structured W-B's, it measures
  - compile: a fresh compile of the grammar for that tokenizer (xgrammar: GrammarCompiler.compile_*, its
    cache off; llguidance: the LLMatcher constructor, which builds the lexer; grammar_from_* included);
  - mask: the time to fill one row's token bitmask at each step of a valid output, fed token by token
    (median and p99 over the steps), single-threaded;
  - batch: one step's masks for 64 rows (different positions of the same output) filled by the library's
    parallel filler (llguidance LLExecutor; xgrammar BatchGrammarMatcher where the version has it), each time
    on fresh rows: llguidance keeps a matcher's mask until it consumes a token, so refilling the same rows
    (what this script did before 2026-12-04, night) timed a cached copy.
Prints a table and writes JSON. Tokenizer set-up (once per process, cached by the server) is reported apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.structured_mix import SCHEMA as RECORD_SCHEMA  # noqa: E402  (the H200 structured W-B's schema)

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}, {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "owner": {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                                                   "score": {"type": "number"}}, "required": ["email"]}},
        "required": ["id", "tags", "owner"]},
        {"id": 7, "tags": ["a", "c"], "owner": {"email": "ada@example.com", "score": 1.5}}),
    "record": (RECORD_SCHEMA, {"id": 12, "title": "open server request", "status": "open", "tags": ["a", "token"],
                               "owner": {"name": "ada", "email": "ada@model.com"}, "score": 1.5}),
    "wide": ({"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]}
                                               for i in range(40)}, "required": [f"field_{i}" for i in range(40)]},
             {f"field_{i}": (i if i % 3 == 0 else (f"v{i}" if i % 3 == 1 else True)) for i in range(40)}),
}
REGEX = (r"\d{3}-\d{4} [A-Z][a-z]+", "555-1234 Alice")
CHOICE = (["positive", "negative", "neutral"], "neutral")


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t) * 1000


def summary(samples_ms: list[float]) -> dict:
    s = sorted(samples_ms)
    return {"median_ms": statistics.median(s), "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))]}


class LLG:
    name = "llguidance"

    def __init__(self, hf_tok, vocab: int):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok, self.setup_ms = timed(lambda: llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab))
        self.vocab = vocab
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec):
        M = self.llg.LLMatcher
        grammar = {"json": lambda: M.grammar_from_json_schema(json.dumps(spec)), "regex": lambda: M.grammar_from_regex(spec),
                   "choice": lambda: M.grammar_from_regex("|".join(map(_re_escape, spec)))}[kind]()
        m = M(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, mask):
        m.unsafe_compute_mask_ptr(mask[0].data_ptr(), mask.shape[1] * 4)

    def accept(self, m, token):
        assert m.consume_token(token)

    def fill_batch(self, matchers, mask):
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                              mask.shape[1] * 4, mask.shape[0])


class XGR:
    name = "xgrammar"

    def __init__(self, hf_tok, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info, self.setup_ms = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab))
        self.vocab = vocab
        self.batch = getattr(xgr, "BatchGrammarMatcher", None)

    def compile(self, kind: str, spec):
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_regex("|".join(map(_re_escape, spec)))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask):
        m.fill_next_token_bitmask(mask, 0)

    def accept(self, m, token):
        assert m.accept_token(token)

    def fill_batch(self, matchers, mask):
        if self.batch is None:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, i)
            return
        self.batch().batch_fill_next_token_bitmask(matchers, mask)


def _re_escape(s: str) -> str:
    import re

    return "(" + re.escape(s) + ")"


def measure(engine, kind: str, spec, text: str, hf_tok, batch: int) -> dict:
    compiled, compile_ms = timed(lambda: engine.compile(kind, spec))
    _, compile2_ms = timed(lambda: engine.compile(kind, spec))
    tokens = hf_tok.encode(text, add_special_tokens=False)
    mask = torch.zeros(batch, (engine.vocab + 31) // 32, dtype=torch.int32)
    m, fills = engine.matcher(compiled), []
    for t in tokens:
        fills.append(timed(lambda: engine.fill(m, mask))[1])
        engine.accept(m, t)
    batch_ms = []
    for _ in range(5):  # fresh rows each time: llguidance keeps a matcher's mask until its next token
        rows = rows_at_positions(engine, compiled, tokens, batch)
        batch_ms.append(timed(lambda: engine.fill_batch(rows, mask))[1])
    return {"compile_ms": min(compile_ms, compile2_ms), "tokens": len(tokens), **summary(fills),
            "batch": batch, "batch_fill_ms": statistics.median(batch_ms)}


def rows_at_positions(engine, compiled, tokens: list[int], batch: int) -> list:
    """`batch` matchers, row i after the output's first i % len(tokens) tokens: one step of a batch whose
    rows are at every point of the output."""
    rows = [engine.matcher(compiled) for _ in range(batch)]
    for i, row in enumerate(rows):
        for t in tokens[:i % len(tokens)]:
            engine.accept(row, t)
    return rows


def load_tokenizer(name: str):
    """(HF tokenizer, vocabulary size) of --tokenizer."""
    from transformers import AutoTokenizer

    if name == "wb-bpe":
        import tempfile

        from bench.bpe_tokenizer import save_bpe_tokenizer

        out = Path(tempfile.mkdtemp(prefix="wb-bpe-"))
        save_bpe_tokenizer(151936, 151643, out)  # Qwen2.5-0.5B's vocabulary size and EOS id
        return AutoTokenizer.from_pretrained(out), 151936
    from tests.conftest import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: unchanged)")
    ap.add_argument("--tokenizer", choices=("smollm2", "wb-bpe"), default="smollm2",
                    help="smollm2: the embedded model's (49,152 ids); wb-bpe: the byte-level BPE of the H200 "
                         "structured W-B's random model (bench/bpe_tokenizer.py, 151,936 ids)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_tok, vocab = load_tokenizer(args.tokenizer)
    cases = [(f"json:{k}", "json", s, json.dumps(v)) for k, (s, v) in SCHEMAS.items()]
    cases += [("regex", "regex", REGEX[0], REGEX[1]), ("choice", "choice", CHOICE[0], CHOICE[1])]
    results = {}
    for cls in (LLG, XGR):
        try:
            engine = cls(hf_tok, vocab)
        except ImportError as e:  # xgrammar is not on every host (the H200's is vLLM's, in /tmp/vllm-site)
            print(f"skipped {cls.__name__}: {e}")
            continue
        results[engine.name] = {"tokenizer_setup_ms": engine.setup_ms}
        for name, kind, spec, text in cases:
            results[engine.name][name] = measure(engine, kind, spec, text, hf_tok, args.batch)
    print(f"{'engine':<11} {'case':<12} {'compile ms':>10} {'mask med ms':>11} {'mask p99':>9} "
          f"{'batch' + str(args.batch) + ' ms':>11}")
    for eng, rs in results.items():
        print(f"{eng:<11} {'tokenizer':<12} {rs['tokenizer_setup_ms']:>10.1f}")
        for case, r in rs.items():
            if case != "tokenizer_setup_ms":
                print(f"{eng:<11} {case:<12} {r['compile_ms']:>10.2f} {r['median_ms']:>11.3f} {r['p99_ms']:>9.3f} "
                      f"{r['batch_fill_ms']:>11.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
