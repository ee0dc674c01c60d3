"""Structured outputs with the matchers in a grammar process of their own (engine/grammar_worker.py says why).

GrammarLink has StructuredOutputs' interface for the engine (compile, new_grammar, start_fill, fill, apply,
shutdown); a completion's grammar is a RemoteGrammar, a number the worker knows. Its accept() only records the
token: the worker consumes it with the next Step, and a token the matcher refuses comes back in that Step's
Filled (RemoteGrammar.broken), so the request fails at its next token (the row was sampled under an
allow-everything mask meanwhile; a bypassed mask is the only way to get there). A matcher is dropped when its
RemoteGrammar is collected (the request finished, or its grammar ended).

With several grammar processes (Shard: one each) a grammar lives in one of them, by its number; every step
sends each its own Step and the rows it fills (the others marked -1) into the one shared bitmask.

A Step and its Filled go over a Unix socket pair (multiprocessing.connection framing): one wake-up each way,
where ZeroMQ added its I/O thread's on each side. Under W-B at json 100% on a busy 16-core host a Step took
0.10-0.57 ms to reach its worker and its answer was read 0.16-0.82 ms late (docs/benchmarks.md, ninth
session); on the 2-core CPU a fill of 8 rows over 4 processes took 317-323 us (median) against 417-453 us
through ZeroMQ's ipc sockets. Compiles, not on any step's path, stay on ZeroMQ.

If a worker dies, its rows of the step in flight allow everything, every grammar it held is broken (its
request fails with an error at its next token), compiles in flight fail, and a new worker is started; the
engine, its unconstrained requests and the other workers' grammars go on.
"""
from __future__ import annotations

import itertools
import logging
import os
import pickle
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future

import msgspec
import torch

from engine.config import usable_cores
from engine.grammar import LRU, GrammarLimits
from engine.grammar_messages import WORKER_TIMES, Compile, Filled, NewMatcher, Step
from engine.grammar_process import (LOST, POLL_MS, READY_TIMEOUT_S, GrammarProcess, GrammarProcessError,  # noqa: F401
                                    kill_all)
from engine.grammar_worker import FLAGS, MASK_BUFFERS, OTHERS, WorkerSpec, mask_buffers, mask_file_words
from engine.mask_gate import RELEASED
from engine.request import Request, StructuredOutput
from engine.structured import CACHE_SIZE, Masking, MaskBatch

logger = logging.getLogger(__name__)

# The engine thread spins this long for a step's answer before it blocks, on hosts of SPIN_MIN_CORES or more.
# Through the server on H100 hosts (16 cores) the answer was read 0.2-0.27 ms after the worker sent it, while
# the engine waited (docs/benchmarks.md, ninth and tenth sessions: the wake-up of a blocked thread); in the
# slow repetitions of W-B json 100% (TPOT 7.5 against 5.5 ms) the engine core was busy 0.95 of a core
# against 1.10, so it waited longer. The engine thread has nothing else to do meanwhile, and its core is
# its own on such a host; on a smaller one it would take the worker's. Unmeasured on the GPU host so far.
SPIN_S = 0.003
SPIN_MIN_CORES = 8
# A step reserved and not sent this long means the engine thread waits for the device, which waits for that
# step's masks (watch_reserved). Between the two the engine reads the previous step (milliseconds; a long
# prefill step stays under a second).
STALL_S = 10.0


class Shard:
    """One grammar process, and what its next Step carries: the matchers made, the tokens consumed and the
    matchers dropped since its last one. A grammar lives in one shard (its gid modulo their number)."""
    __slots__ = ("index", "worker", "new", "accept_gids", "accept_tokens", "dropped", "live")

    def __init__(self, index: int, worker: GrammarProcess) -> None:
        self.index, self.worker, self.live = index, worker, 0
        self.new: list[NewMatcher] = []
        self.accept_gids: list[int] = []
        self.accept_tokens: list[int] = []
        self.dropped: deque[int] = deque()

    def take_step(self, fill: list[int], buffer: int, seq: int) -> Step:
        """The Step of what accumulated, filling `fill`'s rows; the lists start over."""
        dropped = self.dropped
        step = Step(self.new, self.accept_gids, self.accept_tokens, [dropped.popleft() for _ in range(len(dropped))],
                    fill, buffer, seq)
        self.new, self.accept_gids, self.accept_tokens = [], [], []
        return step


class RemoteGrammar:
    """One completion's grammar, held by its shard's worker under `gid`."""
    __slots__ = ("gid", "shard", "broken")

    def __init__(self, gid: int, shard: Shard) -> None:
        self.gid, self.shard, self.broken = gid, shard, None

    def accept(self, token: int) -> bool:
        """Recorded for the next Step; False once the worker said this grammar is broken."""
        self.shard.accept_gids.append(self.gid)
        self.shard.accept_tokens.append(token)
        return self.broken is None

    def error(self) -> str | None:
        return self.broken

    def __del__(self) -> None:
        self.shard.dropped.append(self.gid)  # a deque: safe whenever the collector runs this


class PendingMasks:
    """A step's masks: reserved (numbered, given a buffer), then sent to the shards' workers; result() waits for
    every Filled (once: a second call returns the same masks), sending first if that was not done. `sent`:
    (shard, worker, time.monotonic() of the send) for each that was sent one; None until sent."""
    __slots__ = ("link", "sent", "rows", "grammars", "buffer", "seq", "batch")

    def __init__(self, link: GrammarLink, sent: list[tuple[Shard, GrammarProcess, float]] | None, rows: list[int],
                 grammars: list, buffer: int, seq: int) -> None:
        self.link, self.sent, self.rows, self.grammars, self.buffer = link, sent, rows, grammars, buffer
        self.seq = seq
        self.batch: MaskBatch | None = None

    def result(self) -> MaskBatch:
        if self.sent is None:
            self.link.send(self)
        if self.batch is None:
            self.batch = self.link._collect(self)
        return self.batch


class GrammarLink:
    """StructuredOutputs' interface for the engine, the matchers in `processes` grammar processes (shards).
    Each consumes its grammars' tokens and fills their rows of one shared bitmask, all at once: xgrammar's
    consume holds the GIL and its batch fill gained little past 8 threads in one process (sixth session)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids, limits: GrammarLimits, backend: str,
                 max_rows: int, processes: int = 1, spin_s: float | None = None,
                 fill_threads: int | None = None) -> None:
        """spin_s: how long the engine thread polls for a step's answer before it blocks (None: SPIN_S on a host
        of SPIN_MIN_CORES usable cores or more, else 0). fill_threads: xgrammar's fill threads in each process
        (None: half the usable cores shared among the processes; with one process, xgrammar's own default)."""
        from engine.grammar_xgr import available as xgrammar_available

        self.args = (hf_tokenizer, vocab_size, eos_ids, limits, backend)  # StructuredOutputs' (the fallback)
        self.use_xgrammar = backend == "xgrammar" or backend == "auto" and xgrammar_available()
        self.words, self.rows = (vocab_size + 31) // 32, max_rows
        threads = fill_threads_per_process(processes, fill_threads)
        self.spin_s = spin_s if spin_s is not None else SPIN_S if usable_cores() >= SPIN_MIN_CORES else 0.0
        self._spec = pickle.dumps(WorkerSpec(hf_tokenizer, vocab_size, sorted(eos_ids), limits, backend, max_rows,
                                             threads))
        if processes > FLAGS:
            raise ValueError(f"at most {FLAGS} grammar processes")
        nbytes = mask_file_words(max_rows, self.words) * 4
        self._mask_file = tempfile.TemporaryFile(dir=mask_dir(nbytes))
        os.ftruncate(self._mask_file.fileno(), nbytes)
        self.masks, self.flags = mask_buffers(self._mask_file.fileno(), max_rows, self.words)
        self.pinned = _pin(self.masks, nbytes)  # page-locked: the device can copy them and read the flags
        self._masking = Masking()
        self._cache = LRU(CACHE_SIZE)  # StructuredOutput.key() -> Future[StructuredOutput], compiled in the workers
        self._keys, self._gids = itertools.count(), itertools.count()
        self._seqs = itertools.count(1)  # the flags start at 0: step 0 would count as filled
        self._buffer = 0
        self._outstanding: PendingMasks | None = None
        self._unsent: tuple[int, float] | None = None  # (seq, time.monotonic()) of a step reserved, not yet sent
        self._watch: threading.Thread | None = None  # watch_reserved
        self._closed = threading.Event()
        self.stalled = False  # a reserved step stayed unsent: the device no longer waits (watch_reserved)
        self.worker_s = dict.fromkeys(WORKER_TIMES, 0.0)  # per step the slowest shard's, summed
        self.restarts = 0  # workers started after one died
        self._encoder = msgspec.msgpack.Encoder()
        self._filled = msgspec.msgpack.Decoder(Filled)
        self.shards = [Shard(k, self._start_worker()) for k in range(processes)]
        self._workers = [shard.worker for shard in self.shards]  # every worker started, killed at exit
        weakref.finalize(self, kill_all, self._workers)
        self._release = weakref.finalize(self, release_masks, self.masks, self.flags, self.pinned, os.getpid())

    @property
    def worker(self) -> GrammarProcess:
        """The first shard's worker (the only one by default)."""
        return self.shards[0].worker

    @property
    def live(self) -> int:
        """Matchers the workers hold, as of their last Filled (tests check that none leak)."""
        return sum(shard.live for shard in self.shards)

    def _start_worker(self) -> GrammarProcess:
        return GrammarProcess(self._spec, self._mask_file.fileno())

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str | None:
        """None once every worker is ready, else why not (the engine then fills masks in its own process)."""
        for shard in self.shards:
            error = shard.worker.wait_ready(timeout_s)
            if error is not None:
                return error
        return None

    # ---- compiling -------------------------------------------------------------------------------
    def compile(self, so: StructuredOutput) -> Future:
        """A future of the constraint (a CompiledConstraint), resolved once every worker has compiled it. The
        first shard compiles it first and its choice of engine goes to the others: a worker falls back to
        llguidance where xgrammar fails or takes over its timeout, which one process could meet and another
        not, and a grammar's engine would then depend on its shard (its masks' speed, forced tokens' spelling).
        With several shards this costs the first request of a constraint one compile more (xgrammar: 1-10 ms)."""
        self._check_workers()
        key = so.key()
        future = self._cache.get(key)
        if future is None:
            future, n = Future(), next(self._keys)
            first = self._send_compile(self.shards[0], n, so, "")
            first.add_done_callback(lambda done: self._compile_rest(done, n, so, future))
            self._cache.put(key, future)
        return future

    def _send_compile(self, shard: Shard, n: int, so: StructuredOutput, engine: str) -> Future:
        piece = Future()
        shard.worker.compiles[n] = (piece, so)
        shard.worker.compile(self._encoder.encode(Compile(n, so, engine)))
        return piece

    def _compile_rest(self, first: Future, n: int, so: StructuredOutput, future: Future) -> None:
        """The first shard's compile is done (in its reply thread): the other shards compile with its engine."""
        if first.exception() is not None:
            future.set_exception(first.exception())
            return
        engine = first.result().engine
        _all_of([first] + [self._send_compile(shard, n, so, engine) for shard in self.shards[1:]], future)

    def new_grammar(self, compiled: Future) -> RemoteGrammar:
        gid = next(self._gids)
        shard = self.shards[gid % len(self.shards)]
        chosen = compiled.result()
        shard.new.append(NewMatcher(gid, chosen.constraint, chosen.engine))
        return RemoteGrammar(gid, shard)

    # ---- masks -----------------------------------------------------------------------------------
    def start_fill(self, requests: list[Request]) -> PendingMasks | None:
        """reserve() then send(): the masks of these requests' rows, filling."""
        pending = self.reserve(requests)
        if pending is not None:
            self.send(pending)
        return pending

    def reserve(self, requests: list[Request]) -> PendingMasks | None:
        """A step's masks, numbered and given a buffer, not yet asked for (send). Its rows are fixed now; the
        tokens its matchers consume are those recorded until send. None: no row is constrained."""
        rows, grammars = [], []
        for i, r in enumerate(requests):
            if r.grammar is not None:
                rows.append(i)
                grammars.append(r.grammar)
        if not rows:
            return None
        if len(rows) > self.rows:
            raise RuntimeError(f"{len(rows)} constrained rows in a step; the masks hold {self.rows} (max_num_seqs)")
        pending = PendingMasks(self, None, rows, grammars, self._buffer, next(self._seqs))
        self._buffer = (self._buffer + 1) % MASK_BUFFERS
        self._unsent = (pending.seq, time.monotonic())
        return pending

    def send(self, pending: PendingMasks) -> None:
        """Send each shard the tokens consumed since its last Step, its new and dropped matchers, and its rows
        of `pending` to fill (-1 where another shard's). A shard whose worker is still starting loses its rows
        at once (they allow every token), not after its 3-5 s start."""
        self._check_workers()
        if self._outstanding is not None:  # its step failed before sampling: read its answer, use nothing
            self._outstanding.result()
        fills = [[OTHERS] * len(pending.rows) for _ in self.shards]
        for i, grammar in enumerate(pending.grammars):
            fills[grammar.shard.index][i] = grammar.gid
        pending.sent = []
        for shard, fill in zip(self.shards, fills):  # every shard: its drops and tokens go too, rows or not
            if not shard.worker.ready.is_set():
                self._lose(shard, pending)
                continue
            step = shard.take_step(fill, pending.buffer, pending.seq)
            step.flag = shard.index
            shard.worker.send_step(self._encoder.encode(step))
            pending.sent.append((shard, shard.worker, time.monotonic()))
        self._outstanding, self._unsent = pending, None

    def release(self, pending: PendingMasks) -> None:
        """A reserved step that will not be sent (its sampling failed): whatever waits on its flags goes on.
        The Step before it is read first, so its worker cannot lower a flag raised here."""
        if pending.sent is not None:
            return
        if self._outstanding is not None:
            self._outstanding.result()
        for shard in self.shards:
            self._raise_flag(shard, pending.seq)
        self._unsent = None

    def fill(self, requests: list[Request]) -> MaskBatch | None:
        pending = self.start_fill(requests)
        return None if pending is None else pending.result()

    def _collect(self, pending: PendingMasks) -> MaskBatch:
        """Wait for every shard's Filled of this step (answers to steps given up on are skipped); a broken
        grammar learns why. A lost worker: its rows allow every token, and its grammars of the step are broken."""
        if self._outstanding is pending:
            self._outstanding = None
        rows, waiting_from, times = self.masks[pending.buffer, :len(pending.rows)], time.monotonic(), []
        for shard, worker, sent_at in pending.sent:
            filled = self._receive(worker, pending.seq)
            if filled is None:
                self._lose(shard, pending)
                continue
            by_gid = {g.gid: g for g in pending.grammars} if filled.broken else None
            for gid, why in zip(filled.broken, filled.why):
                by_gid[gid].broken = why
            shard.live = filled.live
            times.append(_worker_times(filled, sent_at, waiting_from))
        for name, seconds in zip(WORKER_TIMES, map(max, zip(*times))):
            self.worker_s[name] += seconds
        return MaskBatch(pending.rows, rows)

    def _receive(self, worker: GrammarProcess, seq: int) -> Filled | None:
        """The worker's Filled with this seq, or None if the worker is gone (or was replaced)."""
        while any(shard.worker is worker for shard in self.shards) and worker.alive():
            try:
                if not worker.answered(self.spin_s, POLL_MS / 1000):
                    continue
                filled = self._filled.decode(worker.step.recv_bytes())
            except (EOFError, OSError):  # its end closed: it is exiting
                worker.exit_code()
                return None
            if filled.seq == seq:
                return filled
        return None

    def _lose(self, shard: Shard, pending: PendingMasks) -> None:
        """A shard's worker is gone (or still starting): its rows of the step allow every token, its grammars
        there are broken, and its flag is raised for the device (engine/mask_gate.py)."""
        rows = self.masks[pending.buffer, :len(pending.rows)]
        for i, grammar in enumerate(pending.grammars):
            if grammar.shard is shard:
                rows[i].fill_(-1)
                grammar.broken = LOST
        self._raise_flag(shard, pending.seq)

    def _raise_flag(self, shard: Shard, seq: int) -> None:
        if int(self.flags[shard.index]) < seq:
            self.flags[shard.index] = seq

    def apply(self, logits: torch.Tensor, batch: MaskBatch) -> None:
        self._masking.apply(logits, batch)

    def masks_on_device(self, logits: torch.Tensor) -> bool:
        return self._masking.masks_on_device(logits)

    def row_index(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        return self._masking.row_index(logits, rows)

    def apply_on_device(self, logits: torch.Tensor, masks: torch.Tensor, index: torch.Tensor | None) -> None:
        self._masking.apply_on_device(logits, masks, index)

    # ---- the device's wait, watched -------------------------------------------------------------
    def watch_reserved(self) -> None:
        """Watch, from a thread, for a reserved step left unsent STALL_S (the device waits for its flags, and
        only send raises them): then raise every flag and set `stalled`, so the runner stops gating. Nothing the
        engine does between reserve and send should wait for the device (engine/runner.py _sample_gated); should
        something do so anyway, that step's masks are stale (its matchers refuse what it sampled, failing those
        requests), instead of the engine hanging for good."""
        if self._watch is None:
            self._watch = threading.Thread(target=self._watch_loop, name="kvserve-mask-watch", daemon=True)
            self._watch.start()

    def _watch_loop(self) -> None:
        while not self._closed.wait(STALL_S / 10):
            unsent = self._unsent
            if unsent is not None and time.monotonic() - unsent[1] > STALL_S and self._unsent is unsent:
                logger.error("grammar masks: step %d was reserved %.0f s ago and not sent; raising the flags",
                             unsent[0], time.monotonic() - unsent[1])
                self.flags.fill_(RELEASED)
                self.stalled = True  # after the flags: whoever sees it finds them raised

    # ---- the workers' lives ----------------------------------------------------------------------
    def _check_workers(self) -> None:
        """A lost worker is replaced: what it held is gone (those grammars are unknown to the new one), and every
        compiled constraint is compiled again (the new worker has none). It starts in the background."""
        for shard in self.shards:
            if shard.worker.alive():
                continue
            logger.error("a grammar process exited (code %s): starting another", shard.worker.proc.poll())
            shard.worker.stop()
            self._cache = LRU(CACHE_SIZE)
            self._outstanding = None
            shard.new, shard.accept_gids, shard.accept_tokens = [], [], []
            shard.dropped.clear()
            shard.worker = self._start_worker()
            self.restarts += 1
            self._workers.append(shard.worker)

    def shutdown(self) -> None:
        self._closed.set()
        for shard in self.shards:
            shard.worker.stop()
        if (release := self._release.detach()) is not None:  # every step was read: no copy is in flight
            release_masks(*release[2], in_flight=False)
        self._mask_file.close()


def fill_threads_per_process(processes: int, asked: int | None = None) -> int | None:
    """xgrammar's fill threads in each grammar process: `asked`, else half the usable cores shared among the
    processes (at least 1), else with one process None (xgrammar's default: half the host's threads)."""
    if asked is not None:
        return asked
    return None if processes == 1 else max(1, usable_cores() // (2 * processes))


def _worker_times(filled: Filled, sent_at: float, waiting_from: float) -> tuple[float, ...]:
    """WORKER_TIMES of one answer: its consume and fill, the Step's way there, and how long after the answer
    was sent the engine read it, counted from when the engine began to wait (before that it was busy)."""
    late = time.monotonic() - max(filled.answered, waiting_from)
    return filled.accept_s, filled.fill_s, filled.received - sent_at, max(0.0, late)


def _all_of(pieces: list[Future], future: Future) -> None:
    """`future` takes the first piece's result once every piece is done, or the first exception among them."""
    lock, left = threading.Lock(), [len(pieces)]

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        error = next((p.exception() for p in pieces if p.exception() is not None), None)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(pieces[0].result())

    for piece in pieces:
        piece.add_done_callback(done)


def mask_dir(nbytes: int, shm: str = "/dev/shm") -> str | None:
    """/dev/shm when it has room for the masks twice over, else the temporary directory: Docker's default
    /dev/shm is 64 MiB, and a page of a mapped file beyond a full tmpfs is a SIGBUS, not an error. The masks
    are ~10 MB at 256 rows of a 152k-token vocabulary."""
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    return shm if st.f_bavail * st.f_frsize >= 2 * nbytes else None


def _pin(masks: torch.Tensor, nbytes: int | None = None) -> bool:
    """Page-lock the shared masks (and the flags behind them: `nbytes` from the masks' start) on CUDA hosts, so
    their copy to the device runs asynchronously and the device reads the flags (engine/mask_gate.py)."""
    if not torch.cuda.is_available():
        return False
    nbytes = nbytes or masks.numel() * masks.element_size()
    code = int(torch.cuda.cudart().cudaHostRegister(masks.data_ptr(), nbytes, 0))
    if code != 0:
        _drop_cuda_error()
        logger.warning("could not page-lock the grammar masks (cudaHostRegister: %s): their copies wait", code)
    return code == 0


def release_masks(masks: torch.Tensor, flags: torch.Tensor, pinned: bool, pid: int, in_flight: bool = True) -> None:
    """At shutdown, or when a link is collected unshut: every wait queued on the device returns, then the masks
    are unpinned while still mapped. A mapping freed pinned left CUDA holding its range, and the next link mapped
    at that address could not pin its masks (cudaHostRegister: 712), seen on a GPU host after a test's engine was
    collected unshut. `in_flight`: a copy from the masks may still be queued (collected unshut), so the device
    is synchronized first. Only the process that pinned them unpins (a forked child runs the finalizers at its
    exit too, and cannot use CUDA)."""
    flags.fill_(RELEASED)
    if pinned and os.getpid() == pid:
        try:
            if in_flight:
                torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(masks.data_ptr())
        except RuntimeError as e:  # a device already failed: teardown goes on, the process is ending anyway
            logger.warning("could not unpin the grammar masks: %s", e)


def _drop_cuda_error() -> None:
    """A failed cudaHostRegister stays the CUDA runtime's last error, and the next kernel launch anywhere in the
    process raises it: on a GPU host the engine's KV allocation failed with 712 right after the warning of _pin. A
    launch here reads the error back, which clears it."""
    try:
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:  # the registration's error, read back by this launch; the launch itself cannot fail
        pass
