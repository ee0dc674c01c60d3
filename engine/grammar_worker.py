"""The grammar process: the matchers of structured outputs, away from the engine's GIL.

    python -m engine.grammar_worker SPEC_FILE STEP_FD COMPILE_ADDR REPLY_ADDR MASK_FD   (started by GrammarLink)

Why a process: in the engine's process a matcher's consume (xgrammar's accept holds the GIL) runs on the
engine thread, ~0.5-0.7 ms of a ~4.4-5.3 ms step at 256 rows, and the batch fill in a thread took 3.7-6.4 ms
beside the busy engine thread against ~2 ms alone (H100 host, docs/results/2026-12-05-s6). Here both run on
a GIL of their own: per constrained step the engine only sends the tokens it read and the rows to fill
(engine/grammar_messages.py Step) and reads the Filled answer once the bitmask (shared memory) is written.

The worker holds an in-process StructuredOutputs (compiling, its LRU cache, both grammar engines' fills).
Its main thread answers Steps; a second thread answers Compiles. It exits when its engine is gone.
"""
from __future__ import annotations

import functools
import os
import pickle
import shutil
import sys
import time
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import zmq

from engine.grammar import GrammarLimits
from engine.grammar_messages import Compile, Compiled, Filled, NewMatcher, Ready, Step
from engine.request import RequestError

PARENT_CHECK_MS = 1000  # how often an idle worker checks that its engine still lives
MASK_BUFFERS = 2  # the engine alternates them, so a buffer is not rewritten while its copy to the device runs
UNKNOWN = "the grammar process holds no grammar for this request (it was restarted)"
OTHERS = -1  # a Step's fill entry for a row another grammar process fills (GrammarLink shares the rows)
FLAGS = 64  # flags in the shared file: one per grammar process (GrammarLink starts at most this many)


@dataclass
class WorkerSpec:
    """What the worker builds its StructuredOutputs from (pickled into SPEC_FILE by the engine)."""
    hf_tokenizer: object
    vocab_size: int
    eos_ids: list[int]
    limits: GrammarLimits
    backend: str
    rows: int  # rows of each mask buffer: the engine's max_num_seqs
    fill_threads: int | None = None  # xgrammar's batch fill threads (None: half the host's hardware threads)


def mask_file_words(rows: int, words: int) -> int:
    """int32 words of the shared file: the bitmasks, then FLAGS int64 flags, rounded up to whole pages. The
    file is page-locked from its start for its whole size (GrammarLink): a last page only partly inside that
    range is the one the flags sit in. On an H100 the device's waits on flags there never ended, where a flag in a
    whole registered page was read at once (seventeenth session: the leading suspect, unconfirmed)."""
    page_words = os.sysconf("SC_PAGE_SIZE") // 4
    need = MASK_BUFFERS * rows * words + 2 * FLAGS
    return -(-need // page_words) * page_words


def mask_buffers(fd: int, rows: int, words: int):
    """The shared bitmask, [MASK_BUFFERS, rows, words] int32, and the flags, [FLAGS] int64 (flag k: the seq of
    the last Step whose rows grammar process k wrote; engine/mask_gate.py waits on them), mapped from the file
    behind `fd`. The bitmask's size is even, so the flags are 8-byte aligned."""
    import torch

    count = MASK_BUFFERS * rows * words
    flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=mask_file_words(rows, words), dtype=torch.int32)
    return flat[:count].view(MASK_BUFFERS, rows, words), flat[count:count + 2 * FLAGS].view(torch.int64)


class Worker:
    """The matchers by the engine's grammar id; those that refused a token stay, marked broken, until dropped."""

    def __init__(self, spec: WorkerSpec, masks, flags=None) -> None:
        from engine.structured import StructuredOutputs

        self.structured = StructuredOutputs(spec.hf_tokenizer, spec.vocab_size, spec.eos_ids, spec.limits,
                                            spec.backend)
        self.structured.switch_interval_s = None  # no mask thread here
        self.structured.fill_threads = spec.fill_threads
        self.masks, self.flags = masks, flags
        self.matchers: dict[int, object] = {}
        self.broken: dict[int, str] = {}
        self._compile_lock = threading.Lock()  # the LRU of compiled grammars is shared by both threads

    def compile(self, constraint, engine: str = ""):
        with self._compile_lock:
            return self.structured.compile(constraint, engine)

    def engine_of(self, pristine) -> str:
        return self.structured.engine_of(pristine)

    def step(self, msg: Step) -> Filled:
        """The Step applied, then its flag raised (the rows are written); an exception fails the step's grammars
        (rows allow everything) instead of the worker, which would otherwise be restarted and fail the same way
        at every step."""
        try:
            filled = self._step(msg)
        except Exception as exc:  # noqa: BLE001 - reported per request; the worker goes on
            why = f"the grammar process failed: {type(exc).__name__}: {exc}"[:300]
            mine = [(row, gid) for row, gid in enumerate(msg.fill) if gid != OTHERS]  # not another process's
            for row, gid in mine:
                self.masks[msg.buffer, row] = -1
                self.broken[gid] = why
            filled = Filled(msg.seq, [gid for _, gid in mine], [why] * len(mine), len(self.matchers))
        if msg.flag >= 0 and self.flags is not None:
            self.flags[msg.flag] = msg.seq  # after the rows: a store after stores, seen in order (x86-64)
        return filled

    def _step(self, msg: Step) -> Filled:
        for new in msg.new:
            self._new(new)
        start = time.perf_counter()
        self._accept(msg.accept_gids, msg.accept_tokens)
        accepted = time.perf_counter()
        for gid in msg.drop:
            self.matchers.pop(gid, None)
            self.broken.pop(gid, None)
        filled = self._fill(msg.seq, msg.fill, self.masks[msg.buffer])
        filled.accept_s, filled.fill_s = accepted - start, time.perf_counter() - accepted
        return filled

    def _new(self, new: NewMatcher) -> None:
        try:
            self.matchers[new.gid] = self.structured.new_grammar(self.compile(new.constraint, new.engine))
        except Exception as exc:  # noqa: BLE001 - the request fails; the worker goes on
            self.broken[new.gid] = getattr(exc, "message", None) or f"grammar: {type(exc).__name__}"

    def _accept(self, gids: list[int], tokens: list[int]) -> None:
        matchers, broken = self.matchers, self.broken
        for gid, token in zip(gids, tokens):
            grammar = matchers.get(gid)
            if grammar is not None and gid not in broken and not grammar.accept(token):
                broken[gid] = f"the output cannot follow the request's constraint: {grammar.error()}"[:300]

    def _fill(self, seq: int, gids: list[int], buffer) -> Filled:
        from engine.structured import split_by_engine

        live, broken, why = [], [], []
        for row, gid in enumerate(gids):
            if gid == OTHERS:
                continue
            grammar = self.matchers.get(gid)
            if grammar is None or gid in self.broken:
                buffer[row] = -1  # every token allowed: the engine fails the request at its next token
                broken.append(gid)
                why.append(self.broken.get(gid, UNKNOWN))
            else:
                live.append((grammar, row))
        if live:
            self.structured.fill_into(buffer[:len(gids)], *split_by_engine(live))
        return Filled(seq, broken, why, len(self.matchers))


def answer_compiles(worker: Worker, pull: zmq.Socket, push: zmq.Socket) -> None:
    """The compile thread (its sockets connected by the main thread before Ready): each Compile is answered once
    its grammar is compiled (or failed), in the order they finish, so one slow to compile holds no other (the
    compiles run side by side: engine/structured.py). The answers go out under a lock: they are sent from the
    compile threads, and a ZeroMQ socket is used by one thread at a time."""
    decoder, encoder, lock = msgspec.msgpack.Decoder(Compile), msgspec.msgpack.Encoder(), threading.Lock()

    def answer(msg: Compile, compiled: Future) -> None:
        with lock:
            push.send(encoder.encode(_compiled(worker, msg, compiled)))

    with pull, push:
        while True:
            msg = decoder.decode(pull.recv())
            _compiling(worker, msg).add_done_callback(functools.partial(answer, msg))


def _compiling(worker: Worker, msg: Compile) -> Future:
    """The compile's future; one that could not even start is a failed future (answered, not fatal to the
    thread that answers every compile)."""
    try:
        return worker.compile(msg.constraint, msg.engine)
    except Exception as exc:  # noqa: BLE001 - answered as the compile's failure
        failed = Future()
        failed.set_exception(exc)
        return failed


def _compiled(worker: Worker, msg: Compile, compiled: Future) -> Compiled:
    try:
        engine = worker.engine_of(compiled.result())
    except RequestError as exc:
        return Compiled(msg.key, exc.message, exc.code, exc.param)
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which fails the requests
        return Compiled(msg.key, f"grammar: {type(exc).__name__}: {exc}"[:300])
    return Compiled(msg.key, engine=engine)


def serve_steps(worker: Worker, conn: Connection, parent: int) -> None:
    """Answer each Step with its Filled, until the engine's process is gone (its end of the channel closes; a
    parent that changed is checked too, every PARENT_CHECK_MS)."""
    decoder, encoder = msgspec.msgpack.Decoder(Step), msgspec.msgpack.Encoder()
    try:
        while True:
            if not conn.poll(PARENT_CHECK_MS / 1000):
                if os.getppid() != parent:
                    return
                continue
            data = conn.recv_bytes()
            received = time.monotonic()
            filled = worker.step(decoder.decode(data))
            filled.received, filled.answered = received, time.monotonic()
            conn.send_bytes(encoder.encode(filled))
    except (EOFError, OSError):  # the engine is gone
        return


def main(argv: list[str]) -> None:
    spec_file, step_fd, compile_addr, reply_addr, fd = argv
    parent, context = os.getppid(), zmq.Context.instance()
    conn = Connection(int(step_fd))
    encoder = msgspec.msgpack.Encoder()
    try:
        import torch

        torch.set_num_threads(1)  # torch only maps the masks here; xgrammar and llguidance bring their threads
        with open(spec_file, "rb") as f:
            spec: WorkerSpec = pickle.load(f)
        os.unlink(spec_file)  # read once (the engine removes it too, should this process die first)
        worker = Worker(spec, *mask_buffers(int(fd), spec.rows, (spec.vocab_size + 31) // 32))
    except Exception as exc:  # noqa: BLE001 - told to the engine, which then fills masks in its own process
        conn.send_bytes(encoder.encode(Ready(f"{type(exc).__name__}: {exc}")))
        return
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(compile_addr)
    push.connect(reply_addr)
    threading.Thread(target=answer_compiles, args=(worker, pull, push), daemon=True,
                     name="kvserve-grammar-compiles").start()
    conn.send_bytes(encoder.encode(Ready()))
    serve_steps(worker, conn, parent)
    if compile_addr.startswith("ipc://"):  # the engine is gone (killed: it could not remove its sockets' folder)
        shutil.rmtree(os.path.dirname(compile_addr[len("ipc://"):]), ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # the compile thread and the grammar engines' pools do not hold the exit
