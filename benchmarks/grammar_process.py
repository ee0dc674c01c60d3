"""What moving the matchers into a process of their own would cost the engine thread: the lever issue 15 has
left (docs/structured_outputs.md "Limits"). Under one GIL a constrained step's grammar work lands on the
engine thread: the matchers' consume (xgrammar's accept holds the GIL) and the wait for a fill that shares the
GIL with the engine's Python. Here the same step is timed both ways, with the engine's own Python simulated by
a busy loop of --window-ms between reading a step's tokens and sampling the next:

- thread:  consume in the engine thread, then the batch fill in a thread (what engine/structured.py does);
- process: the tokens go to a grammar process (pyzmq + msgspec), which consumes and fills a shared-memory
  bitmask, and answers with the rows whose matcher refused its token.

Per step it reports the engine thread's cost beyond the window (what a step gets longer by), split into the
work it does itself and the time it waits. Rows walk bench/structured_mix.py's record schema along one
document on the byte-level BPE of the H200 pair (151,936 ids), each row at a different position.

    python benchmarks/grammar_process.py --batch 256 --steps 40 --out grammar_process.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

DOC = {"id": 12345, "title": "A fairly long title for the record that goes on for a while", "status": "pending",
       "tags": ["alpha", "beta", "gamma", "delta", "epsilon"],
       "owner": {"name": "Some Person With A Name", "email": "some.one@example.com"}, "score": 3.25}


class Step(msgspec.Struct, tag=True):
    tokens: list[int]  # per row, the token it consumes before its mask is filled


class Done(msgspec.Struct, tag=True):
    refused: list[int]  # rows whose matcher refused its token


class Stop(msgspec.Struct, tag=True):
    pass


def setup(batch: int, steps: int):
    """(matchers at staggered positions, the document's tokens, xgrammar's batch matcher, words per row)."""
    import xgrammar

    from bench.structured_mix import SCHEMA
    from benchmarks.grammar_engines import load_tokenizer, rows_at_positions
    from engine.grammar_xgr import json_ebnf

    tok, vocab = load_tokenizer("wb-bpe")
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[151643])
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_grammar(json_ebnf(SCHEMA))
    doc = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    if len(doc) <= steps:
        raise SystemExit(f"--steps must stay below the document's {len(doc)} tokens")
    rows = SimpleNamespace(matcher=xgrammar.GrammarMatcher, accept=lambda m, t: m.accept_token(t))
    matchers = rows_at_positions(rows, compiled, doc[:len(doc) - steps], batch)  # room for `steps` more tokens
    return matchers, doc, xgrammar.BatchGrammarMatcher(), (vocab + 31) // 32


def step_tokens(doc: list[int], batch: int, steps: int, k: int) -> list[int]:
    """Step k's token for each row: the next one of the document at the row's position."""
    return [doc[i % (len(doc) - steps) + k] for i in range(batch)]


def grammar_process(address: str, shm_name: str, batch: int, steps: int) -> None:
    """The grammar process: consume, fill the shared bitmask, answer; until Stop."""
    import numpy as np
    import torch
    import zmq

    matchers, _, batcher, words = setup(batch, steps)
    shm = shared_memory.SharedMemory(name=shm_name)
    mask = torch.from_numpy(np.ndarray((batch, words), dtype=np.int32, buffer=shm.buf))
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    decoder, encoder = msgspec.msgpack.Decoder(Step | Stop), msgspec.msgpack.Encoder()
    sock.send(encoder.encode(Done([])))  # ready
    rows = list(range(batch))
    while not isinstance(msg := decoder.decode(sock.recv()), Stop):
        refused = [i for i, (m, t) in enumerate(zip(matchers, msg.tokens)) if not m.accept_token(t)]
        batcher.batch_fill_next_token_bitmask(matchers, mask, rows)
        sock.send(encoder.encode(Done(refused)))
    del mask
    shm.close()


def busy(ms: float) -> None:
    """The engine's own Python between reading a step's tokens and sampling the next (detokenization,
    scheduling, staging), as a loop that holds the GIL."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def run_thread(args) -> tuple[list[dict], "torch.Tensor"]:
    import torch

    matchers, doc, batcher, words = setup(args.batch, args.steps)
    mask, rows = torch.empty(args.batch, words, dtype=torch.int32), list(range(args.batch))
    pool, out = ThreadPoolExecutor(1), []
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    for k in range(args.steps):
        tokens = step_tokens(doc, args.batch, args.steps, k)
        t0 = time.perf_counter()
        assert all(m.accept_token(t) for m, t in zip(matchers, tokens))
        fill = pool.submit(batcher.batch_fill_next_token_bitmask, matchers, mask, rows)
        t1 = time.perf_counter()
        busy(args.window_ms)
        t2 = time.perf_counter()
        fill.result()
        t3 = time.perf_counter()
        out.append({"work_ms": (t1 - t0) * 1e3, "window_ms": (t2 - t1) * 1e3, "wait_ms": (t3 - t2) * 1e3})
    pool.shutdown()
    return out, mask


def run_process(args) -> tuple[list[dict], "torch.Tensor"]:
    import numpy as np
    import torch
    import zmq

    _, doc, _, words = setup(1, args.steps)
    shm = shared_memory.SharedMemory(create=True, size=args.batch * words * 4)
    sock = zmq.Context.instance().socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=grammar_process,
                                           args=(f"tcp://127.0.0.1:{port}", shm.name, args.batch, args.steps))
    proc.start()
    encoder, decoder, out = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Done), []
    try:
        decoder.decode(sock.recv())  # ready
        for k in range(args.steps):
            tokens = step_tokens(doc, args.batch, args.steps, k)
            t0 = time.perf_counter()
            sock.send(encoder.encode(Step(tokens)))
            t1 = time.perf_counter()
            busy(args.window_ms)
            t2 = time.perf_counter()
            done = decoder.decode(sock.recv())
            t3 = time.perf_counter()
            assert not done.refused
            out.append({"work_ms": (t1 - t0) * 1e3, "window_ms": (t2 - t1) * 1e3, "wait_ms": (t3 - t2) * 1e3})
        sock.send(encoder.encode(Stop()))
        proc.join(30)
        mask = torch.from_numpy(np.ndarray((args.batch, words), dtype=np.int32, buffer=shm.buf).copy())
    finally:
        if proc.is_alive():
            proc.kill()
        shm.close()
        shm.unlink()
    return out, mask


def summarize(name: str, steps: list[dict]) -> dict:
    """Medians over the steps after the first two (warm-up)."""
    rows = steps[2:]
    med = {k: statistics.median(r[k] for r in rows) for k in ("work_ms", "window_ms", "wait_ms")}
    med["beyond_window_ms"] = med["work_ms"] + med["wait_ms"]
    print(f"{name:8s} engine thread: work {med['work_ms']:6.3f} ms  window {med['window_ms']:6.3f} ms  "
          f"wait {med['wait_ms']:6.3f} ms  -> step longer by {med['beyond_window_ms']:6.3f} ms", flush=True)
    return {**med, "steps": steps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--window-ms", type=float, default=2.5, help="the engine's Python between tokens and sampling")
    p.add_argument("--switch-interval-ms", type=float, default=0.2, help="the thread form's GIL switch interval")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    (thread, thread_mask), (process, process_mask) = run_thread(args), run_process(args)
    same = bool((thread_mask == process_mask).all())  # the same rows walked the same tokens: the same masks
    print(f"last step's masks equal in both forms: {same}")
    result = {"batch": args.batch, "window_ms": args.window_ms, "cores": mp.cpu_count(), "masks_equal": same,
              "thread": summarize("thread", thread), "process": summarize("process", process)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
