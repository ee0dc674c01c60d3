"""Sixteenth session, on the 2-core CPU: how alike are a step's grammar masks under issue 15's W-B json 100%,
and what would sending each distinct row once cost the host? (Owed 3 in docs/benchmarks.md: fewer mask bytes.)

256 completions of bench/structured_mix.py's SCHEMA (compact JSON) through xgrammar over bench/bpe_tokenizer.py's
151,936-id tokenizer, each sampled greedily from random logits under its mask for 128 tokens (a random model, as
online_pair.py's servers run). Per step: live rows, distinct rows, words all-allowed / all-banned / mixed. Then,
at 64 rows (one grammar process's share), the fill's time against finding the distinct rows by their bytes.

    PYTHONPATH=. python docs/results/2026-12-06-s16/mask_rows.py     # ~10 min on the 2-core CPU
"""
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from bench.bpe_tokenizer import save_bpe_tokenizer
from bench.structured_mix import SCHEMA

VOCAB, EOS = 151936, 151643


def compiled_schema():
    out = Path(tempfile.mkdtemp())
    save_bpe_tokenizer(VOCAB, EOS, out)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


def walk(compiled, rows: int, steps: int, on_step) -> None:
    """Greedy decoding from random logits under each row's mask; on_step(live, bitmask) after each fill."""
    matchers, bitmask = [xgr.GrammarMatcher(compiled) for _ in range(rows)], xgr.allocate_token_bitmask(rows, VOCAB)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        on_step(live, lambda: [matchers[i].fill_next_token_bitmask(bitmask, i) for i in live], bitmask)
        logits = torch.randn(len(live), VOCAB, generator=gen)
        xgr.apply_token_bitmask_inplace(logits, bitmask[live])
        for i, token in zip(live, logits.argmax(1).tolist()):
            assert matchers[i].accept_token(token)


def likeness(compiled) -> dict:
    totals = dict(rows=0, distinct=0, words=0, ones=0, zeros=0)

    def on_step(live, fill, bitmask):
        fill()
        words = bitmask[live].numpy().view(np.uint32)
        totals["rows"] += len(live)
        totals["distinct"] += len({row.tobytes() for row in words})
        totals["words"] += words.size
        totals["ones"] += int((words == 0xFFFFFFFF).sum())
        totals["zeros"] += int((words == 0).sum())

    walk(compiled, 256, 128, on_step)
    return totals


def host_cost(compiled) -> dict:
    fills, dedups = [], []

    def on_step(live, fill, bitmask):
        start = time.perf_counter()
        fill()
        fills.append(time.perf_counter() - start)
        words, start = bitmask.numpy(), time.perf_counter()
        seen = {}
        [seen.setdefault(words[i].tobytes(), i) for i in live]
        dedups.append(time.perf_counter() - start)

    walk(compiled, 64, 60, on_step)
    return dict(fill_us=float(np.median(fills) * 1e6), distinct_by_bytes_us=float(np.median(dedups) * 1e6))


if __name__ == "__main__":
    compiled = compiled_schema()
    t = likeness(compiled)
    print(f"256 rows x 128 steps: distinct rows {t['distinct'] / t['rows']:.1%} of live rows; words all-allowed "
          f"{t['ones'] / t['words']:.1%}, all-banned {t['zeros'] / t['words']:.1%}, "
          f"mixed {1 - (t['ones'] + t['zeros']) / t['words']:.1%}")
    c = host_cost(compiled)
    print(f"64 rows: xgrammar fill {c['fill_us']:.0f} us a step; finding the distinct rows by their bytes "
          f"{c['distinct_by_bytes_us']:.0f} us")
