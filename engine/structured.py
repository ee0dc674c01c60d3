"""Structured outputs in the engine: grammars compiled off the step loop (a thread, LRU-cached by constraint),
one matcher per completion, and each step's token bitmask applied to the logits of the constrained rows on the
device before sampling.

A step with constrained rows is launched (forward and logits queued on the device) before the previous step's
tokens are read; the engine then reads them, the matchers consume them, and only then are the step's masks
filled (xgrammar's batch fill for JSON schemas and regexes, llguidance's parallel executor for the rest:
engine/grammar_xgr.py says why) and its rows sampled: the fill overlaps the forward pass on the device,
and the async-scheduling pipeline keeps running. A mask allows EOS only where the grammar may end. A matcher
consumes each token the engine appends, so preemption (recompute) and prefix-cache hits leave it where it was.

This is the in-process form (the default without CUDA); with CUDA the engine keeps all of it in a grammar
process of its own (engine/grammar_link.py, whose worker runs an instance of this class).
"""
from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from engine import mask_kernel
from engine.grammar import LRU, EosAliases, GrammarLimits, grammar_text, llg_tokenizer
from engine.grammar_xgr import COMPILE_THREADS, XgrCompiled, XgrCompiler, XgrGrammar
from engine.grammar_xgr import available as xgrammar_available
from engine.request import Request, RequestError, StructuredOutput

logger = logging.getLogger(__name__)

MASK_SWITCH_INTERVAL_S = 0.0002  # sys.setswitchinterval once masks fill in their own thread (start_fill)
CACHE_SIZE = 256  # compiled grammars kept (a pristine matcher each; requests get copies)


class Grammar:
    """One completion's position in its grammar."""
    __slots__ = ("matcher", "aliases")

    def __init__(self, matcher, aliases: EosAliases | None = None) -> None:
        self.matcher = matcher
        self.aliases = aliases

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token if self.aliases is None else self.aliases.token(token))

    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


@dataclass
class MaskBatch:
    rows: list[int]  # the rows of the step's sampled logits that are constrained
    bitmask: torch.Tensor  # [len(rows), words] int32 on the host: bit j of word w allows token 32 * w + j


class StructuredOutputs:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids, limits: GrammarLimits | None = None,
                 backend: str = "auto") -> None:
        self.hf_tokenizer = hf_tokenizer
        self.use_xgrammar = backend == "xgrammar" or backend == "auto" and xgrammar_available()
        self._xgr: XgrCompiler | None = None  # built in the compile thread on first use
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_ids = frozenset(eos_ids)
        self.limits = limits or GrammarLimits()
        self._tokenizer = None  # the llguidance tokenizer, built in the compile thread on first use
        self._aliases: EosAliases | None = None  # EOS ids that tokenizer does not know (set with it)
        self._executor = None  # llguidance.LLExecutor, made on the first fill
        self._compiles = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="kvserve-grammar")
        self._setup_lock = threading.Lock()  # the compile threads make the compilers once, on first use
        self._fills: ThreadPoolExecutor | None = None  # start_fill's thread, made on first use
        self._filling: Future | None = None  # the last start_fill's job: a fill may outlive its step() call
        self._cache = LRU(CACHE_SIZE)  # StructuredOutput.key() -> Future[pristine matcher]
        self._masking = Masking()
        self.switch_interval_s: float | None = MASK_SWITCH_INTERVAL_S  # None: the interpreter's is kept
        self.fill_threads: int | None = None  # xgrammar's batch fill threads (None: half the host's)

    # ---- compiling (engine thread submits, one helper thread compiles) ---------------------------------
    def compile(self, so: StructuredOutput, engine: str = "") -> Future:
        """A future of the constraint's compiled matcher (shared: take copies with new_grammar). engine
        "llguidance": compiled by llguidance whatever xgrammar would take (a grammar process told which engine its
        link's first shard chose, engine/grammar_link.py); else xgrammar where it takes the constraint. The
        first compile of a constraint decides: the cache keeps it."""
        key = so.key()
        future = self._cache.get(key)
        if future is None:
            future = self._compiles.submit(self._compile, so, engine != "llguidance")
            self._cache.put(key, future)
        return future

    def _compile(self, so: StructuredOutput, xgrammar_first: bool = True):
        if self.use_xgrammar and xgrammar_first:
            with self._setup_lock:
                if self._xgr is None:
                    self._xgr = XgrCompiler(self.hf_tokenizer, self.vocab_size, self.eos_ids, self.fill_threads,
                                            self.limits)
            compiled = self._xgr.compile(so)
            if compiled is not None:
                return compiled
        return self._compile_llg(so)

    def _compile_llg(self, so: StructuredOutput):
        from llguidance import LLMatcher

        with self._setup_lock:
            if self._tokenizer is None:
                self._tokenizer = llg_tokenizer(self.hf_tokenizer, self.vocab_size, self.eos_ids)
                self._aliases = EosAliases.of(self._tokenizer, self.eos_ids)
        matcher = LLMatcher(self._tokenizer, grammar_text(so), log_level=0, limits=self.limits.to_llguidance())
        if matcher.is_error():
            raise RequestError(f"{so.param()}: {matcher.get_error()[:500]}", "invalid_grammar", so.param())
        return matcher

    @staticmethod
    def engine_of(pristine) -> str:
        """Which engine compiled what a compile's future holds (grammar_messages.ENGINES)."""
        return "xgrammar" if isinstance(pristine, XgrCompiled) else "llguidance"

    def new_grammar(self, compiled: Future) -> Grammar | XgrGrammar:
        """A matcher of its own; made only while no fill runs (the mask thread reads the matchers, and a fill
        started at the end of one step() call runs on into the next: engine.LLMEngine._step_behind_masks)."""
        if self._filling is not None:
            wait([self._filling])
        pristine = compiled.result()
        if isinstance(pristine, XgrCompiled):
            return pristine.new_grammar()
        return Grammar(pristine.deep_copy(), self._aliases)

    # ---- masks (the runner: filled once the previous step's tokens are consumed, applied before sampling) --
    def start_fill(self, requests: list[Request]) -> Future:
        """fill() in a thread of its own, for a step whose rows' matchers have consumed every earlier token: the
        engine goes on meanwhile (detokenization, the next step's scheduling and inputs); both engines' fills
        release the GIL. Which rows are constrained is read now, in the caller's thread. The matchers consume
        tokens in the engine thread, not here: xgrammar's accept holds the GIL, and in a thread beside the busy
        engine thread 256 of them took 4.1 ms (0.2 ms switch interval) to 99 ms (5 ms) against 0.37 ms alone
        (2-core development machine; on an H100 host the thread's consume + fill took 4.2 ms a step against
        a 1.3 ms fill, docs/results/2026-12-05-s5/a)."""
        if self._fills is None:
            self._fills = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-masks")
        if self.switch_interval_s is not None and sys.getswitchinterval() > self.switch_interval_s:
            # The mask thread's fill returns only once it gets the GIL back: with CPython's default 5 ms switch
            # interval a 4.5 ms fill beside a busy engine thread took 10 ms, at 0.2 ms 5.4 ms. Process-wide.
            sys.setswitchinterval(self.switch_interval_s)
        self._filling = self._fills.submit(self._fill_rows, *self._constrained_rows(requests))
        return self._filling

    def fill(self, requests: list[Request]) -> MaskBatch | None:
        """The bitmasks of the rows under a grammar: xgrammar's rows by its batch fill, llguidance's by its
        parallel executor (it releases the GIL and spreads rows over 80% of the cores)."""
        return self._fill_rows(*self._constrained_rows(requests))

    @staticmethod
    def _constrained_rows(requests: list[Request]) -> tuple[list[int], list, list]:
        """(the rows under a grammar, xgrammar's (matcher, mask row) pairs, llguidance's)."""
        rows, grammars = [], []
        for i, r in enumerate(requests):
            if r.grammar is not None:
                grammars.append((r.grammar, len(rows)))
                rows.append(i)
        return (rows, *split_by_engine(grammars))

    def _fill_rows(self, rows: list[int], xgr: list, llg: list) -> MaskBatch | None:
        if not rows:
            return None
        bitmask = torch.empty(len(rows), self.words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        self.fill_into(bitmask, xgr, llg)
        return MaskBatch(rows, bitmask)

    def fill_into(self, bitmask: torch.Tensor, xgr: list, llg: list) -> None:
        """Fill the rows named by xgrammar's and llguidance's (matcher, row) pairs; other rows are left alone."""
        if xgr:
            self._xgr.fill(xgr, bitmask)
        if llg:
            self._fill_llg(llg, bitmask)
            if self._aliases is not None:  # only llguidance's rows: other rows may be another process's
                rows = torch.tensor([row for _, row in llg])
                masks = bitmask[rows]
                _allow_like(masks, self._aliases)
                bitmask[rows] = masks

    def _fill_llg(self, rows: list, bitmask: torch.Tensor) -> None:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])

    def apply(self, logits: torch.Tensor, batch: MaskBatch) -> None:
        self._masking.apply(logits, batch)

    def shutdown(self) -> None:
        self._compiles.shutdown(wait=False, cancel_futures=True)
        if self._fills is not None:
            self._fills.shutdown(wait=False, cancel_futures=True)
        if self._xgr is not None:
            self._xgr.shutdown()


def split_by_engine(grammars: list[tuple]) -> tuple[list, list]:
    """(grammar, mask row) pairs as (xgrammar's (matcher, row) pairs, llguidance's): what fill_into takes."""
    xgr, llg = [], []
    for grammar, row in grammars:
        (xgr if type(grammar) is XgrGrammar else llg).append((grammar.matcher, row))
    return xgr, llg


class Masking:
    """Applies a step's bitmasks to its logits: on CUDA kvserve's kernel (engine/mask_kernel.py, once it passed
    its self-check on that device and dtype), else xgrammar's (Triton on CUDA, C++ on the CPU) when xgrammar
    is installed, else apply_reference. On CUDA the mask's copy runs on a stream of its own, so it overlaps
    the forward pass instead of queueing behind it.

    Why a kernel: at batch 256 of a 151,936-token vocabulary the reference unpacks every bit into int32
    tensors (~0.7 GB of device memory traffic, six launches) where the kernel reads the 4.9 MB mask and
    writes -inf where banned; on the 2-core CPU it took 41-49 ms against xgrammar's 16-17 ms at 64 rows of
    49,152. tests/test_structured_masking.py checks both against apply_reference on random masks."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._kernel = _xgrammar_kernel()
        self._own: dict[tuple[torch.device, torch.dtype], bool] = {}  # mask_kernel passed its self-check there

    def apply(self, logits: torch.Tensor, batch: MaskBatch) -> None:
        """Disallowed tokens of the constrained rows get -inf, in place, on the logits' device."""
        if logits.is_cuda and self._use_own(logits):
            self._apply_own(logits, batch.rows, self._to_device(batch.bitmask, logits.device))
            return
        if self._kernel is None:
            apply_reference(logits, batch)
            return
        mask = self._to_device(batch.bitmask, logits.device)
        if len(batch.rows) < logits.shape[0]:  # the kernel indexes mask and logits by the same row
            full = torch.full((logits.shape[0], mask.shape[1]), -1, dtype=torch.int32, device=logits.device)
            full[self._to_device(_index(batch.rows, logits.device), logits.device)] = mask
            mask = full
        self._kernel(logits, mask, vocab_size=min(logits.shape[1], mask.shape[1] * 32))

    def masks_on_device(self, logits: torch.Tensor) -> bool:
        """Whether apply_on_device can run on these logits (kvserve's kernel passed its check for them)."""
        return logits.is_cuda and self._use_own(logits)

    def row_index(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """What apply_on_device takes for these rows: None when they are 0..n-1, else their index, staged now
        (a page-locked copy: engine/runner.py _sample_gated stages it before the device waits for the masks)."""
        if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
            return None
        return self._to_device(_index(rows, logits.device), logits.device)

    def apply_on_device(self, logits: torch.Tensor, masks: torch.Tensor, index: torch.Tensor | None) -> None:
        """apply() with the masks already on the logits' device (engine/mask_gate.py copied them there), for the
        rows of row_index. Only kernels are queued: masks_on_device must hold."""
        mask_kernel.apply_mask(logits, masks, index)

    def _apply_own(self, logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
        """engine/mask_kernel.py on the logits' rows `rows` (an index only when they are not 0..n-1, ~2 us)."""
        mask_kernel.apply_mask(logits, masks, self.row_index(logits, rows))

    def _use_own(self, logits: torch.Tensor) -> bool:
        """Whether engine/mask_kernel.py runs on this device and dtype: checked against the reference once."""
        key = (logits.device, logits.dtype)
        if key not in self._own:
            why = mask_kernel.self_check(logits.device, logits.dtype, 4099) if mask_kernel.available() else \
                "no triton"
            self._own[key] = why is None
            if why is None:
                logger.info("grammar masks: kvserve's kernel on %s (%s)", logits.device, logits.dtype)
            else:
                logger.warning("grammar masks: kvserve's kernel not used on %s (%s): %s", logits.device,
                               logits.dtype, why)
        return self._own[key]

    def _to_device(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The host mask on `device`; on CUDA copied on the side stream, which the current stream waits for."""
        if device.type != "cuda":
            return bitmask
        stream, current = self._streams.get(device), torch.cuda.current_stream(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            mask = bitmask.to(device, non_blocking=True)
        current.wait_stream(stream)
        mask.record_stream(current)  # not reused by the side stream's pool before the current one used it
        return mask


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """The rows as an int64 tensor, page-locked for a CUDA device: a copy from pageable memory waits for the
    stream's work queued before it (the forward pass), so the host could not run ahead."""
    return torch.tensor(rows, dtype=torch.long, pin_memory=device.type == "cuda")


def _xgrammar_kernel():
    """xgrammar.apply_token_bitmask_inplace, or None without xgrammar."""
    if not xgrammar_available():
        return None
    from xgrammar import apply_token_bitmask_inplace

    return apply_token_bitmask_inplace


def apply_reference(logits: torch.Tensor, batch: MaskBatch) -> None:
    """The rule in PyTorch: bit j of word w of a row's mask clear -> token 32 * w + j of that row is -inf."""
    dev, vocab = logits.device, logits.shape[1]
    mask = batch.bitmask.to(dev, non_blocking=True)  # [m, words]
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=dev)) & 1  # [m, words, 32]
    banned = bits.view(len(batch.rows), -1)[:, :vocab] == 0  # [m, vocab]
    rows = torch.tensor(batch.rows, dtype=torch.long, device=dev)
    logits[rows] = logits[rows].masked_fill_(banned, float("-inf"))


def _allow_like(bitmask: torch.Tensor, aliases: EosAliases) -> None:
    """Each of aliases.others is allowed in the rows where aliases.primary is."""
    word, bit = divmod(aliases.primary, 32)
    allowed = (bitmask[:, word] >> bit) & 1
    for token in aliases.others:
        bitmask[:, token // 32] |= allowed << (token % 32)
