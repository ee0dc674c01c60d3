"""ModelRunner: owns the KV pool, turns a SchedulerOutput into model inputs, runs the model, samples."""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from attention.base import PAD_SLOT_ID, GraphSupport
from attention.metadata import AttentionMetadataBuilder, SeqSpec
from engine.cuda_graphs import MAX_MIXED_GRAPH_TOKENS, CudaGraphSteps, decode_graph_sizes, mixed_graph_sizes
from engine.device_clock import DeviceClock
from engine.mask_gate import HostRing, MaskGate
from engine.mask_gate import available as mask_gate_available
from engine.malloc import trim_free_memory
from engine.request import Request, TokenLogprob
from engine.sampler import Sampler, logprob_table, read_logprobs
from engine.structured import MaskBatch
from engine.scheduler import SchedulerOutput
from engine.step_clock import StepClock

logger = logging.getLogger(__name__)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens start, start + 1, ... (start >= 1: the first token has none)."""
    start: int
    logprobs: list[TokenLogprob]


@dataclass
class PromptRows:
    """A request's prompt positions in this step whose logits score the next prompt token."""
    request: Request
    flat_start: int  # index of the first such position in the step's flat tokens
    first_pos: int  # its position in the prompt
    count: int


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request_id -> new token, for requests whose step reached the end of their tokens
    logprobs: dict[str, TokenLogprob]  # only for requests that asked for logprobs
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # prompt_logprobs requests only


@dataclass
class StepInputs:
    input_ids: list[int]  # 0 where the token is still on the device (see pending)
    positions: list[int]
    seqs: list[SeqSpec]
    sample_indices: list[int]  # flat token index whose logits are sampled, one per sampling request
    sample_requests: list[Request]
    # (flat token index, request id): inputs sampled by the previous step and not yet read back to the host
    pending: list[tuple[int, str]]
    prompt_rows: list[PromptRows] = field(default_factory=list)  # requests that asked for prompt_logprobs


@dataclass
class PreparedStep:
    """A step's host work done (ModelRunner.prepare), its device work not yet queued (enqueue)."""
    finished_ids: list[str]  # requests the scheduler ended: their sampler state goes at enqueue
    inputs: StepInputs
    graphs: CudaGraphSteps | None  # the CUDA-graph steps that run it (its inputs staged), or None: eager
    size: int  # the graph's padded token count


@dataclass
class StepHandle:
    """A launched step: its sampled tokens stay on the device until collect()."""
    request_ids: list[str]  # one per sampled row
    requests: list[Request]
    tokens: torch.Tensor | None  # [n] int64 on the device
    token_lp: torch.Tensor | None  # [n, vocab] log-probs, only when some request asked for logprobs
    host_tokens: torch.Tensor | None  # [n] pinned host copy, valid once `done` has happened
    done: torch.cuda.Event | None
    prompt_logprobs: dict[str, PromptLogprobs] | None = None  # already on the host
    logits: torch.Tensor | None = None  # [n, vocab] until sampled (a step with grammar rows: engine calls sample)
    masks: Future | None = None  # its grammar masks, filling (start_masks), when started before sample()
    marks: list | None = None  # its device events (engine/device_clock.py DeviceClock.launched), on CUDA
    presampled: torch.Tensor | None = None  # Sampler.presample's scores, when its rows allow it
    with_logprobs: bool = False  # host_tokens holds sampler.logprob_table's values (CUDA), not only the tokens


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    # K and V, every layer.
    return 2 * hf_config.num_hidden_layers * block_size * hf_config.num_key_value_heads * head_dim * elem


def prepare_inputs(out: SchedulerOutput) -> StepInputs:
    """Flatten the scheduled requests into one batch, prefills first (the scheduler already ordered them)."""
    inputs = StepInputs([], [], [], [], [], [])
    input_ids, positions, seqs, pending = inputs.input_ids, inputs.positions, inputs.seqs, inputs.pending
    for sr in out.scheduled:  # every running request, every step: list methods and lookups bound above
        req, start, num_new = sr.request, sr.num_computed_tokens, sr.num_new_tokens
        if num_new == 1:  # a decode, most rows: one token, no slice
            token = req.token_at(start)
            if token is None:  # sampled by the step still in flight
                pending.append((len(input_ids), req.request_id))
                token = 0
            input_ids.append(token)
            positions.append(start)
            if start < len(req.prompt_token_ids) - 1 and req.sampling_params.prompt_logprobs is not None:
                _add_prompt_rows(inputs, req, start, 1)
        else:
            known = req.token_ids_between(start, start + num_new)
            if len(known) < num_new:  # the last input was sampled by the step still in flight
                pending.append((len(input_ids) + num_new - 1, req.request_id))
                known.append(0)
            input_ids += known
            positions += range(start, start + num_new)
            if req.sampling_params.prompt_logprobs is not None:
                _add_prompt_rows(inputs, req, start, num_new)
        seqs.append(SeqSpec(start, num_new, req.block_ids))
        if sr.samples:
            inputs.sample_indices.append(len(input_ids) - 1)
            inputs.sample_requests.append(req)
    return inputs


def _add_prompt_rows(inputs: StepInputs, req: Request, start: int, num_new: int) -> None:
    """Positions start .. start + num_new - 1 were just appended; those before the prompt's last one score a
    prompt token."""
    end = min(start + num_new, len(req.prompt_token_ids) - 1)
    if end > start:
        inputs.prompt_rows.append(PromptRows(req, len(inputs.input_ids) - num_new, start, end - start))


PROMPT_LOGPROB_CHUNK = 256  # rows of full-vocabulary logits at a time (256 x 128k float32 = 128 MiB)


@torch.inference_mode()
def prompt_logprobs(model, hidden: torch.Tensor, rows: list[PromptRows]) -> dict[str, PromptLogprobs]:
    """log_softmax (float32) of the logits at each listed position, read at the next prompt token, with the
    request's top k; computed PROMPT_LOGPROB_CHUNK rows at a time and brought to the host."""
    flat = [r.flat_start + i for r in rows for i in range(r.count)]
    targets = [r.request.prompt_token_ids[r.first_pos + 1 + i] for r in rows for i in range(r.count)]
    k = max(r.request.sampling_params.prompt_logprobs for r in rows)
    chosen, top_v, top_i = [], [], []
    for at in range(0, len(flat), PROMPT_LOGPROB_CHUNK):
        idx = torch.tensor(flat[at:at + PROMPT_LOGPROB_CHUNK], device=hidden.device)
        lp = torch.log_softmax(model.compute_logits(hidden[idx]).float(), dim=-1)
        tgt = torch.tensor(targets[at:at + PROMPT_LOGPROB_CHUNK], device=hidden.device).unsqueeze(1)
        chosen += lp.gather(1, tgt).squeeze(1).tolist()
        v, i = lp.topk(k, dim=-1)
        top_v += v.tolist()
        top_i += i.tolist()
    out, j = {}, 0
    for r in rows:
        kr = r.request.sampling_params.prompt_logprobs
        lps = [TokenLogprob(targets[j + i], chosen[j + i], list(zip(top_i[j + i][:kr], top_v[j + i][:kr])))
               for i in range(r.count)]
        out[r.request.request_id] = PromptLogprobs(r.first_pos + 1, lps)
        j += r.count
    return out


@torch.inference_mode()
def profile_step_peak_bytes(model, hf_config, backend, device: torch.device, dtype: torch.dtype, block_size: int,
                            num_tokens: int, num_seqs: int, max_model_len: int) -> int:
    """Peak device memory a maximal step allocates beyond the weights: prefills of `num_tokens` tokens in
    all (none longer than max_model_len), then logits and sampling for `num_seqs` rows. The KV pool is
    sized with what is left."""
    seq_len = min(num_tokens, max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // block_size)
    kv = _allocate_kv(backend, hf_config, dtype, device, blocks_per_seq * len(lens), block_size)
    seqs = [SeqSpec(0, n, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i, n in enumerate(lens)]
    seqs.sort(key=lambda s: s.query_len == 1)  # a 1-token remainder is a decode: decodes go last
    meta = AttentionMetadataBuilder(block_size, device).build(seqs)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(s.query_len, device=device) for s in seqs])
    hidden = model(ids, positions, kv, meta)  # [num_tokens, hidden]
    rows = torch.zeros(num_seqs, dtype=torch.long, device=device)
    logits = model.compute_logits(hidden[rows]).float()  # [num_seqs, vocab]: the sampler's float32 copy
    torch.softmax(logits, dim=-1).div_(torch.empty_like(logits).exponential_()).argmax(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, hidden, logits
    torch.cuda.empty_cache()
    return peak


def _allocate_kv(backend, hf_config, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    shape = backend.kv_cache_shape(num_blocks, block_size, hf_config.num_key_value_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(hf_config.num_hidden_layers)]


class ModelRunner:
    def __init__(self, model, hf_config, backend, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, use_cuda_graphs: bool) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.dtype, self.vocab_size = dtype, hf_config.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = _allocate_kv(backend, hf_config, dtype, device, num_blocks, block_size)
        self._warm_rows = max_num_batched_tokens, max_num_seqs
        self._warm_threads: int | None = None  # the torch thread count the packed matmuls were built for
        self.warm_up()
        self.builder = AttentionMetadataBuilder(block_size, device)
        self.sampler = Sampler()
        self.structured = None  # engine.structured.StructuredOutputs, set by the engine when it has a tokenizer
        self.mask_gate: MaskGate | None = None  # the device waits for grammar masks (use_structured)
        self._gated_host: HostRing | None = None  # the gated steps' tokens, page-locked once (_sample_gated)
        self.max_num_seqs = max_num_seqs
        self.masked_steps, self.mask_wait_s = 0, 0.0  # steps sampled under grammar masks; their wait for them
        self.clock = StepClock()  # the host's sections (the engine gives its own), and the device's parts:
        self.device_clock = DeviceClock(device.type == "cuda")
        self.decode_graphs: CudaGraphSteps | None = None
        self.mixed_graphs: CudaGraphSteps | None = None
        self._last = StepHandle([], [], None, None, None, None)  # the step launched most recently
        if use_cuda_graphs and device.type == "cuda" and backend.graph_support is not GraphSupport.NEVER:
            self.decode_graphs = self.make_graphs(max_num_seqs, max_model_len, None, capture=True)
            pool = self.decode_graphs.capture()
            if backend.graph_support is GraphSupport.MIXED:
                self.mixed_graphs = self.make_graphs(max_num_seqs, max_model_len, max_num_batched_tokens,
                                                     capture=True)
                self.mixed_graphs.capture(pool)
        if device.type == "cuda":
            self.warm_up_attention(max_num_seqs)

    def warm_up(self) -> None:
        """CPU, packed weights: build oneDNN's primitive for every shape a step can use, now. oneDNN keys
        them by thread count too, so they serve only under the count set here: set it before the engine
        is built (the server does), or the first step under another count builds them all again."""
        if not self.model.is_packed:
            return
        self.model.warm_up_packed(*self._warm_rows)
        self._warm_threads = torch.get_num_threads()
        trim_free_memory()  # the warm-up's large buffers, freed into the arena (engine/malloc.py)

    def warm_up_attention(self, max_num_seqs: int) -> None:
        """Compile the attention kernels eager steps use: prompt chunks always, decode-only batches when no
        decode graph covers them. CUDA graphs compile what they capture; this covers the rest."""
        eager_decodes = self.decode_graphs is None or max_num_seqs > max(self.decode_graphs.sizes)
        shapes = [SeqSpec(0, 2, [0])] + ([SeqSpec(1, 1, [0])] if eager_decodes else [])
        metas = [self.builder.build([spec]) for spec in shapes]
        for meta in metas:
            meta.slot_mapping.fill_(PAD_SLOT_ID)  # block 0 is only read
        impl = self.model.layers[0].self_attn.attn
        impl.warm_up(*self.kv_caches[0], metas)
        torch.cuda.synchronize()

    def use_structured(self, structured, wait: str = "pipeline") -> None:
        """Sample under grammar masks from `structured` (None: no tokenizer, no grammars). On CUDA the mask
        kernel is checked against the reference and compiled now, not while serving (engine/mask_kernel.py;
        xgrammar's, if that one is not used, has a Triton variant for a row count of 1, one for multiples of 16
        and one for the rest, each a fraction of a second). On an H100 a warm-up load (half its rows
        constrained, row counts new to xgrammar's kernel) spent 0.99 ms a step applying masks before this
        warm-up and the page-locked row index (engine/structured.py _index), 0.15 ms after them
        (docs/benchmarks.md, ninth and tenth sessions). wait: EngineConfig.structured_outputs_wait ("auto" or
        "device": the device waits for the masks, engine/mask_gate.py, where it can)."""
        self.structured = structured
        if structured is None or self.device.type != "cuda":
            return
        words = (self.vocab_size + 31) // 32
        try:  # the model's dtype (logits) and float32 (Sampler.presample's scores)
            for dtype, rows in itertools.product((self.dtype, torch.float32), (1, 2, 16)):
                logits = torch.zeros(rows, self.vocab_size, dtype=dtype, device=self.device)
                constrained = list(range(rows if rows < 16 else 2))  # 2 of 16: a batch partly constrained
                mask = torch.full((len(constrained), words), -1, dtype=torch.int32).pin_memory()
                structured.apply(logits, MaskBatch(constrained, mask))
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - serving goes on; a constrained step would meet the error itself
            logger.exception("warming up the grammar-mask kernel failed")
        if wait in ("auto", "device"):  # last: a wait that failed its check may still hold its side stream
            self.mask_gate = _mask_gate(structured, self.device)
            if self.mask_gate is not None:
                self._gated_host = HostRing(self.max_num_seqs)
                self._load_gated_kernels()
                structured.watch_reserved()

    def _load_gated_kernels(self) -> None:
        """Launch once, now, every kernel _sample_gated queues behind the device's wait. CUDA loads a kernel at its
        first launch (lazy module loading, the default since CUDA 12.2), and a load can synchronize the context:
        behind a wait whose masks are not yet asked for, that never returns. On an H100 the gate's kernel-level
        test hung that way (its first int64 sum was queued behind the wait) while the engine, whose kernels had
        all run before, did not (docs/benchmarks.md, eighteenth session). argmax's reduction kernels differ by
        dtype and by the rows' count (its vectorization): each dtype at a spread of counts."""
        counts = sorted({1, 2, 3, 4, 8, 16, 64, 256, self.max_num_seqs} & set(range(1, self.max_num_seqs + 1)))
        for dtype, rows in itertools.product((self.dtype, torch.float32), counts):
            torch.zeros(rows, self.vocab_size, dtype=dtype, device=self.device).argmax(dim=-1)
        torch.cuda.synchronize(self.device)

    def _check_warm(self) -> None:
        # A changed thread count would make every matmul shape a primitive-cache miss, built lazily while
        # serving (a soak saw +100 MB): rebuild them all at once instead, and say so.
        threads = torch.get_num_threads()
        if self._warm_threads is not None and threads != self._warm_threads:
            logger.warning("torch threads changed from %d to %d after the warm-up: rebuilding the packed "
                           "matmuls' primitives (set the thread count before building the engine)",
                           self._warm_threads, threads)
            self.warm_up()

    def make_graphs(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int | None,
                    capture: bool) -> CudaGraphSteps:
        """Decode graphs (max_num_batched_tokens None) or mixed ones, captured when `capture`."""
        max_blocks = -(-max_model_len // self.block_size)
        if max_num_batched_tokens is None:
            num_seqs = min(max_num_seqs, 512)
            sizes = decode_graph_sizes(num_seqs)
        else:  # the padding prompt must fit a block-table row: at most max_blocks * block_size tokens
            sizes = mixed_graph_sizes(min(max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS, max_blocks * self.block_size))
            num_seqs = max_num_seqs
        return CudaGraphSteps(self.model, self.kv_caches, self.builder, sizes, num_seqs, max_blocks, max_num_seqs,
                              self.device, mixed=max_num_batched_tokens is not None, capture=capture)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """A step's host half: its inputs, staged for its CUDA graph when one runs it (enqueue queues it). The
        device is not touched, so the engine prepares step N+2 while step N+1 waits for its grammar masks."""
        self._check_warm()
        inputs = prepare_inputs(out)
        graphs = self._graphs_for(inputs)
        prev_rows = self._prev_rows(inputs) if graphs else None
        size = graphs.stage(inputs.seqs, inputs.input_ids, inputs.positions, prev_rows) if graphs else 0
        return PreparedStep(out.finished_ids, inputs, graphs, size)

    @torch.inference_mode()
    def enqueue(self, step: PreparedStep) -> StepHandle:
        """A prepared step's device half, queued and returned at once: forward, logits, and sampling unless a row
        waits for grammar masks (inputs the previous step sampled are read from its device tensor).
        The previous step must be sampled by now: this step's pending inputs are its tokens."""
        for rid in step.finished_ids:  # after the previous step's sampling: a seeded row's generator
            self.sampler.free(rid)
        inputs = step.inputs
        ids = [r.request_id for r in inputs.sample_requests]
        start = self.device_clock.mark()
        if step.graphs is not None:
            prev = self._last.tokens if inputs.pending else None
            hidden = step.graphs.replay(step.size, len(inputs.input_ids), prev)  # [num_tokens, hidden]
        else:
            hidden = self._run_eager(inputs)
        self.clock.lap("forward")
        handle = StepHandle(ids, inputs.sample_requests, None, None, None, None)
        if inputs.prompt_rows:
            handle.prompt_logprobs = prompt_logprobs(self.model, hidden, inputs.prompt_rows)
        if ids:
            if len(ids) < hidden.shape[0]:  # rows that do not sample: prefill tokens, chunks that end no prompt
                hidden = hidden[self._to_device(inputs.sample_indices)]
            handle.logits = self.model.compute_logits(hidden)  # [n, vocab]
        handle.marks = [start, self.device_clock.mark(), None, None]
        self.clock.lap("logits")
        if not ids:
            self.device_clock.launched(handle.marks)
        elif not self.needs_masks(inputs.sample_requests):
            self.sample(handle)
        else:  # its sampling up to the masks, queued now: the device runs it while they fill, or waits for them
            scores = self.sampler.presample(handle.logits, handle.requests)
            if not self._sample_gated(handle, scores):
                handle.presampled = scores
                self.clock.lap("sample")
        self._last = handle
        return handle

    def needs_masks(self, requests: list[Request]) -> bool:
        """Whether some row samples under a grammar: then the engine calls sample() itself, once the previous
        step's tokens are read and every matcher has consumed them (the forward already runs meanwhile)."""
        return self.structured is not None and any([r.grammar is not None for r in requests])

    def start_masks(self, handle: StepHandle) -> None:
        """Start filling a launched step's grammar masks (its rows' matchers are up to date) for sample(); with the
        gate, send the masks its sampling already waits for on the device (once: later calls do nothing)."""
        if handle.logits is not None and self.structured is not None:
            handle.masks = self.structured.start_fill(handle.requests)
        elif getattr(handle.masks, "sent", True) is None:  # reserved by _sample_gated, not sent yet
            self.structured.send(handle.masks)

    def _sample_gated(self, handle: StepHandle, scores: torch.Tensor | None) -> bool:
        """Queue a constrained step's sampling behind the device's wait for its masks (reserved now, sent by
        start_masks once the previous step's tokens are consumed); a failure releases them. From the wait's
        queueing to that send the host may make no call that waits for the device, which waits for masks only
        the send asks for: no page-locked allocation (cudaHostAlloc), no copy from pageable memory, no read of
        a result. So the row index and the tokens' host buffer (HostRing) are staged before the wait, and only
        kernels are queued after it. False, nothing queued: no gate (or it stalled: GrammarLink.watch_reserved),
        a row needs the masked logits themselves (scores None: logprobs, top-k, ...), or more rows than HostRing
        holds; the host then waits for these masks."""
        if self.mask_gate is not None and self.structured.stalled:
            logger.error("grammar masks: the device's wait stalled; the host waits for them from now on")
            self.mask_gate = None
        if (self.mask_gate is None or scores is None or len(handle.requests) > self._gated_host.width
                or not self.structured.masks_on_device(scores)):
            return False
        pending = handle.masks = self.structured.reserve(handle.requests)
        handle.logits = None
        try:
            index, host = self.structured.row_index(scores, pending.rows), self._gated_host.next(len(handle.requests))
            device_masks = self.mask_gate.copy_when_filled(pending.buffer, len(pending.rows), pending.seq)
            sample_start = self.device_clock.mark()
            self.structured.apply_on_device(scores, device_masks, index)
            handle.tokens, handle.token_lp = scores.argmax(dim=-1), None
            self.mask_gate.used(pending.buffer)
        except BaseException:
            self.structured.release(pending)
            handle.masks = None
            raise
        self.masked_steps += 1
        self._tokens_to_host(handle, sample_start, host)
        return True

    def _tokens_to_host(self, handle: StepHandle, sample_start, host: torch.Tensor | None = None) -> None:
        """Queue the sampled tokens' copy (with their logprobs, when asked: logprob_table) to page-locked host
        memory and the step's last device events: collect() then waits for an event, never for the stream."""
        source = handle.tokens
        if handle.token_lp is not None:
            source = logprob_table(handle.token_lp, handle.tokens, [r.sampling_params for r in handle.requests])
            handle.token_lp, handle.with_logprobs = None, True
        handle.host_tokens = host if host is not None else torch.empty(source.shape, dtype=source.dtype,
                                                                       pin_memory=True)
        handle.host_tokens.copy_(source, non_blocking=True)
        handle.done = self.device_clock.mark()
        if handle.marks is not None:
            handle.marks[2:] = sample_start, handle.done
            self.device_clock.launched(handle.marks)
        self.clock.lap("sample")

    @torch.inference_mode()
    def sample(self, handle: StepHandle) -> None:
        """Sample a launched step's logits (grammar masks first: started by start_masks, or filled now), leaving
        the tokens on the device; a presampled step only masks its scores and takes their argmax."""
        logits, handle.logits, masks = handle.logits, None, None
        if self.structured is not None:
            started, handle.masks = handle.masks, None
            waited = time.perf_counter()
            masks = started.result() if started is not None else self.structured.fill(handle.requests)
            self.clock.lap("mask wait")
            if masks is not None:
                self.masked_steps += 1
                self.mask_wait_s += time.perf_counter() - waited
        sample_start = self.device_clock.mark()
        scores, handle.presampled = handle.presampled, None
        if scores is not None:  # the masks on the scores, then their argmax: the rest was queued before
            if masks is not None:
                self.structured.apply(scores, masks)
            handle.tokens, handle.token_lp = scores.argmax(dim=-1), None
        else:
            if masks is not None:
                self.structured.apply(logits, masks)
            handle.tokens, handle.token_lp = self.sampler.sample_on_device(logits, handle.requests)
        if self.device.type == "cuda":
            self._tokens_to_host(handle, sample_start)
        else:
            self.clock.lap("sample")

    def _graphs_for(self, inputs: StepInputs) -> CudaGraphSteps | None:
        num_tokens, num_prev = len(inputs.input_ids), len(self._last.request_ids)
        for graphs in (self.decode_graphs, self.mixed_graphs):
            if graphs is not None and graphs.can_run(inputs.seqs, num_tokens, num_prev):
                return graphs
        return None

    def _run_eager(self, inputs: StepInputs) -> torch.Tensor:
        input_ids = self._to_device(inputs.input_ids)  # [num_tokens]
        positions = self._to_device(inputs.positions)  # [num_tokens]
        if inputs.pending:
            self._fill_pending(input_ids, inputs.pending)
        meta = self.builder.build(inputs.seqs)
        return self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]

    def _prev_rows(self, inputs: StepInputs) -> list[int]:
        """Per input token: its row in the previous step's sampled tokens, or -1 where the host knows it."""
        prev_rows = [-1] * len(inputs.input_ids)
        for (i, _), row in zip(inputs.pending, self._pending_rows(inputs.pending)):
            prev_rows[i] = row
        return prev_rows

    def _pending_rows(self, pending: list[tuple[int, str]]) -> list[int]:
        """For each pending input, its row in the previous step's sampled tokens (`self._last.tokens`)."""
        if not pending:
            return []
        row_of = dict(zip(self._last.request_ids, range(len(self._last.request_ids))))
        return [row_of[rid] for _, rid in pending]

    def _fill_pending(self, input_ids: torch.Tensor, pending: list[tuple[int, str]]) -> None:
        dst = self._to_device([i for i, _ in pending])
        src = self._to_device(self._pending_rows(pending))
        input_ids[dst] = self._last.tokens[src]

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and read its sampled tokens (and logprobs) on the host."""
        prompt_lps = handle.prompt_logprobs or {}
        if not handle.request_ids:
            return RunnerOutput({}, {}, prompt_lps)
        if handle.masks is not None:  # gated (sample() took the others' masks): its answers say which grammars broke
            waited = time.perf_counter()
            handle.masks.result()  # sends its Step first if the engine has not
            self.mask_wait_s += time.perf_counter() - waited
            self.clock.lap("mask wait")
        if handle.done is not None:
            handle.done.synchronize()
            self.device_clock.settle()
            if not handle.with_logprobs:
                return RunnerOutput(dict(zip(handle.request_ids, handle.host_tokens.tolist())), {}, prompt_lps)
            token_ids, lps = read_logprobs(handle.host_tokens.tolist(), [r.sampling_params for r in handle.requests])
            logprobs = {rid: lp for rid, lp in zip(handle.request_ids, lps) if lp is not None}
            return RunnerOutput(dict(zip(handle.request_ids, token_ids)), logprobs, prompt_lps)
        with torch.inference_mode():
            sampled = self.sampler.to_host(handle.tokens, handle.token_lp,
                                           [r.sampling_params for r in handle.requests])
        self.device_clock.settle()
        logprobs = {rid: lp for rid, lp in zip(handle.request_ids, sampled.logprobs) if lp is not None}
        return RunnerOutput(dict(zip(handle.request_ids, sampled.token_ids)), logprobs, prompt_lps)


def _mask_gate(structured, device: torch.device) -> MaskGate | None:
    """A MaskGate over the grammar processes' shared masks, once its wait passed its check on this device; None
    (the host waits for the masks) with the in-process matchers, without Triton, or where the check failed."""
    flags = getattr(structured, "flags", None)
    if flags is None or not mask_gate_available() or not getattr(structured, "pinned", False):
        logger.info("grammar masks: the host waits for them (no grammar process with page-locked flags, or no "
                    "triton)")
        return None
    for how, copy in itertools.product(MaskGate.WAITS, MaskGate.COPIES):  # the first that passes its check
        gate = _new_gate(structured, flags, device, how, copy)
        if gate is None:
            continue
        why = gate.check()
        if why is None:
            logger.info("grammar masks: the device waits for them (%s, %s copy; engine/mask_gate.py)", how, copy)
            return gate
        logger.warning("grammar masks: %s with the %s copy failed its check (%s)", how, copy, why)
        if gate.stuck:  # its stream still waits: trying another would reset the flags
            break
    logger.warning("grammar masks: the device cannot wait for them here: the host does")
    return None


def _new_gate(structured, flags, device: torch.device, how: str, copy: str) -> MaskGate | None:
    try:
        return MaskGate(structured.masks, flags, len(structured.shards), device, how, copy)
    except Exception as exc:  # noqa: BLE001 - e.g. no cuda-python for the driver's wait
        logger.info("grammar masks: no %s wait (%s: %s)", how, type(exc).__name__, exc)
        return None
