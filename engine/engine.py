"""LLMEngine: one step = schedule() -> runner.prepare() -> runner.enqueue() -> collect() -> postprocess().
Single-threaded by design: the server drives it from the engine-core process (engine/core/), offline
LLM.generate from the caller's thread."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.admission import GrammarAdmission
from engine.completions import Completions
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.loader import load_hf_config, load_model, load_tokenizer, resolve_model_path, tokenizer_path
from engine.malloc import trim_free_memory
from engine.request import FINISHED, FinishReason, Request, RequestError, SamplingParams, StepOutput
from engine.runner import (ModelRunner, PreparedStep, RunnerOutput, StepHandle, kv_bytes_per_block,
                           profile_step_peak_bytes)
from engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from engine.step_clock import StepClock
from engine.step_trace import StepTrace
from engine.setup import (choose_backend, eos_ids, resolve_device, resolve_dtype,
                          resolve_max_num_batched_tokens, structured_outputs,
                          structured_outputs_ready)

logger = logging.getLogger(__name__)

CUDA_GRAPH_RESERVE = 512 << 20  # bytes kept back for captured graphs' private memory pool


@dataclass
class EngineStats:
    scheduler: SchedulerStats
    prompt_tokens_total: int
    generation_tokens_total: int
    idle_invariant_violations: int
    num_steps: int
    grammar_process_restarts: int = 0
    structured_steps: int = 0  # steps sampled under grammar masks
    structured_mask_wait_seconds: float = 0.0  # the engine thread's wait for those masks, summed
    busy_seconds: float = 0.0  # time spent in step(), summed
    section_seconds: list[float] | None = None  # the same by section (engine/step_clock.py SECTIONS), summed
    device_seconds: list[float] | None = None  # the device's time by part (step_clock.DEVICE_PARTS), on CUDA
    grammar_worker_seconds: list[float] | None = None  # the grammar processes' by part (WORKER_TIMES), if any


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)  # unseeded requests draw from the default generators
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(config.max_num_batched_tokens, self.device)
        path = self.model_path = resolve_model_path(config.model)
        self.hf_config = load_hf_config(path)
        self.tokenizer_path = tokenizer_path(config, path)
        self.tokenizer = None if self.tokenizer_path is None else load_tokenizer(self.tokenizer_path)
        self.eos_token_ids = eos_ids(self.hf_config, self.tokenizer)
        self.vocab_size = self.hf_config.vocab_size
        self.max_model_len = min(config.max_model_len or self.hf_config.max_position_embeddings,
                                 self.hf_config.max_position_embeddings)
        head_dim = getattr(self.hf_config, "head_dim", None) or (
            self.hf_config.hidden_size // self.hf_config.num_attention_heads)
        self.backend, self.backend_reason, self.block_size = choose_backend(config, self.device, head_dim, self.dtype)
        self.structured = None if self.tokenizer is None else structured_outputs(  # a grammar process starts
            config, self.tokenizer, self.vocab_size, self.eos_token_ids, self.device)
        self.backend_name = self.backend.name
        model = load_model(path, self.hf_config, self.dtype, self.device, self.backend,
                           pack_for_cpu=config.cpu_packed_weights)
        self.num_kv_blocks = config.num_kv_blocks or self._num_blocks_from_memory(model)
        self.runner = ModelRunner(model, self.hf_config, self.backend, self.device, self.dtype,
                                  self.num_kv_blocks, self.block_size, config.max_num_seqs, self.max_model_len,
                                  self.max_num_batched_tokens, use_cuda_graphs=not config.enforce_eager)
        self.scheduler = Scheduler(self.num_kv_blocks, self.block_size, config.max_num_seqs,
                                   self.max_num_batched_tokens, self.max_model_len, config.enable_prefix_caching)
        self.completions = Completions(self.tokenizer, self.eos_token_ids, config.enable_prefix_caching)
        self._pending: list[StepOutput] = []  # outputs made between steps (aborts), returned by the next step
        self._prompt_tokens = self._generation_tokens = self._idle_violations = self._steps = 0
        self._busy_s = 0.0  # time in step(): stats() -> the busy-seconds counter
        self.clock = self.runner.clock = StepClock()  # the same time by section of the step (engine/step_clock.py)
        self._idle_checked = True  # the invariant is checked once per busy -> idle transition
        self.trace = StepTrace(config.step_trace) if config.step_trace else None
        # Overlap host work with the device's: only a GPU runs ahead of the host.
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None  # launched, not yet collected
        self._unsampled: tuple[SchedulerOutput, StepHandle] | None = None  # launched, waiting for its masks
        self.structured = None if self.structured is None else structured_outputs_ready(self.structured)
        self.runner.use_structured(self.structured, config.structured_outputs_wait)
        # _step_behind_masks (read every step): the host waits for the masks, behind the next step's staging.
        self.pipeline_masks = self.runner.mask_gate is None and config.structured_outputs_wait != "step"
        self._grammars = GrammarAdmission(self.structured, self.scheduler)  # structured requests, compiling
        self._log_start()

    def _num_blocks_from_memory(self, model) -> int:
        per_block = kv_bytes_per_block(self.hf_config, self.block_size, self.dtype)
        if self.device.type != "cuda":
            return max(2, self.config.kv_cache_memory_bytes // per_block)
        c = self.config
        peak = profile_step_peak_bytes(model, self.hf_config, self.backend, self.device, self.dtype, self.block_size,
                                       self.max_num_batched_tokens, c.max_num_seqs, self.max_model_len)
        free, total = torch.cuda.mem_get_info(self.device)
        # What the process and others already use, plus a maximal step's peak, plus room for CUDA graphs.
        budget = total * c.gpu_memory_utilization - (total - free) - peak - CUDA_GRAPH_RESERVE
        logger.info("KV sizing: %.2f GiB in use, step peak %.2f GiB, KV budget %.2f GiB", (total - free) / 2**30,
                    peak / 2**30, budget / 2**30)
        return max(2, int(budget // per_block))

    def _log_start(self) -> None:
        logger.info("kvserve engine: device=%s dtype=%s attention=%s (%s)", self.device, str(self.dtype)[6:],
                    self.backend_name, self.backend_reason)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens of concurrency; max_model_len=%d, "
                    "max_num_batched_tokens=%d", self.num_kv_blocks, self.block_size,
                    self.num_kv_blocks * self.block_size, self.max_model_len, self.max_num_batched_tokens)
        if self.structured is not None:
            logger.info("structured outputs: %s", "xgrammar for JSON schemas and regexes, llguidance for the rest"
                        if self.structured.use_xgrammar else "llguidance")

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request (n completions), or raise RequestError with nothing queued."""
        if request_id in self.completions.children:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        if not prompt_token_ids:
            raise RequestError("prompt must not be empty", param="prompt")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        children = [self.completions.make(request_id, i, prompt_token_ids, params) for i in range(params.n)]
        if params.structured is not None:
            self._grammars.add([c.request for c in children], params.structured)
        else:
            self.scheduler.add_request(children[0].request)  # raises before anything is queued
            for child in children[1:]:
                self.scheduler.add_request(child.request)
        self.completions.register(request_id, children)
        self._prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        """Abort every completion of `request_id`, or the one completion whose id (completion_id) it is."""
        child_ids = self.completions.child_ids(request_id)
        self._grammars.drop(child_ids)
        for child_id in child_ids:
            if child_id in self.completions.by_id:
                self.scheduler.finish_request(child_id, FinishReason.ABORT)
                self._pending.append(self.completions.final_output(child_id, FinishReason.ABORT))

    def has_unfinished_requests(self) -> bool:
        return (bool(self.completions) or bool(self._pending) or self._inflight is not None
                or self._unsampled is not None)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step (_step), its time counted into the busy seconds."""
        start = time.perf_counter()
        self.clock.start()
        try:
            return self._step()
        finally:
            self.clock.lap("outputs")
            self._busy_s += time.perf_counter() - start

    def _step(self) -> list[StepOutput]:
        """Schedule and launch step N, then finish step N-1 while the device works on N (on CUDA, when no
        live request needs the host to know every token before sampling the next: penalties, min_tokens).
        A launched step with rows under a grammar is sampled at the next call (_step_behind_masks)."""
        outputs, self._pending = self._pending, []
        if self._grammars:
            self._grammars.wait_if_idle(self._inflight is not None or self._unsampled is not None)
            outputs += self._grammars.admit(self.completions.failed)
        self.clock.lap("admit")
        if self._unsampled is not None:
            if self._pipelined():
                return self._idle_check(outputs + self._step_behind_masks())
            outputs += self._sample_unsampled()
        if self._inflight is not None and self.completions.num_history:
            outputs += self._finish(self._inflight)
            self._inflight = None
        sched_out = self.scheduler.schedule()
        self.clock.lap("schedule")
        launched = self._launch(sched_out, outputs)
        if self._inflight is not None:  # pipelined: N+1's masks start in the next call, after its admissions
            behind = launched[1] if launched is not None and not self._pipelined() else None
            outputs += self._finish(self._inflight, behind)
            self._inflight = None
        if launched is not None and self.runner.mask_gate is not None:  # its masks, if not asked for yet: every
            self.runner.start_masks(launched[1])  # token before them is consumed (the device waits for them)
        if launched is not None and launched[1].logits is not None:  # rows under a grammar
            if self._pipelined():  # sampled at the next call, once the step after it is prepared
                self._unsampled = launched
                return self._idle_check(outputs)
            launched = self._sample(launched, outputs)
        self._inflight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._finish(launched)
            self._inflight = None
        return self._idle_check(outputs)

    def _pipelined(self) -> bool:
        """Whether a step may be launched before the previous one's tokens are read."""
        return self.pipeline_masks and self.async_scheduling and not self.completions.num_history

    def _step_behind_masks(self) -> list[StepOutput]:
        """Step N+1 is launched and waits for its grammar masks. Schedule and prepare N+2 while they fill, sample
        N+1 and queue N+2 right behind it, then read N+1's tokens (the device has N+2 to run meanwhile): the
        matchers consume them and N+2's masks start filling before this call returns, so they fill while the
        caller sends the outputs and N+1's tokens go out one call sooner. Through the server the caller's loop
        took only 0.10-0.15 ms a step, and W-B at json 100% stayed at 0.70x of json 0% (0.69x before); the
        grammar processes' own time was what the sampling waited for (docs/benchmarks.md, eighth session)."""
        outputs, unsampled = [], self._unsampled
        if self._inflight is not None:  # the step before the first constrained one
            outputs += self._finish(self._inflight, unsampled[1])
            self._inflight = None
        elif unsampled[1].masks is None:
            self.runner.start_masks(unsampled[1])
        sched_out = self.scheduler.schedule()
        self.clock.lap("schedule")
        prepared = self._prepare(sched_out, outputs)
        self._unsampled = None
        sampled = self._sample(unsampled, outputs)
        launched = None if prepared is None else self._enqueue(sched_out, prepared, outputs)
        constrained = launched is not None and launched[1].logits is not None
        if sampled is not None:
            outputs += self._finish(sampled, launched[1] if constrained else None)
        if constrained:
            self._unsampled = launched
        else:  # unconstrained: it sampled already, and is read at the next call
            self._inflight = launched
        return outputs

    def _sample_unsampled(self) -> list[StepOutput]:
        """Leave the pipelined mode (a request needs every token on the host, or async scheduling was turned
        off): finish the sampled step, then sample the launched one; it is the step in flight."""
        outputs, unsampled = [], self._unsampled
        self._unsampled = None
        if self._inflight is not None:
            outputs += self._finish(self._inflight, unsampled[1])
        self._inflight = self._sample(unsampled, outputs)
        return outputs

    def _launch(self, sched_out: SchedulerOutput, outputs: list[StepOutput]
                ) -> tuple[SchedulerOutput, StepHandle] | None:
        """runner.prepare, then runner.enqueue."""
        prepared = self._prepare(sched_out, outputs)
        return None if prepared is None else self._enqueue(sched_out, prepared, outputs)

    def _prepare(self, sched_out: SchedulerOutput, outputs: list[StepOutput]) -> PreparedStep | None:
        if not self._count_step(sched_out):
            return None
        prepared = self._guarded(sched_out, outputs, lambda: self.runner.prepare(sched_out))
        self.clock.lap("prepare")
        return prepared

    def _enqueue(self, sched_out: SchedulerOutput, prepared: PreparedStep, outputs: list[StepOutput]
                 ) -> tuple[SchedulerOutput, StepHandle] | None:
        return self._guarded(sched_out, outputs, lambda: (sched_out, self.runner.enqueue(prepared)))

    def _sample(self, launched: tuple[SchedulerOutput, StepHandle], outputs: list[StepOutput]
                ) -> tuple[SchedulerOutput, StepHandle] | None:
        """Sample a step whose rows waited for grammar masks."""
        sched_out, handle = launched
        return self._guarded(sched_out, outputs, lambda: self.runner.sample(handle) or launched, "sampling")

    def _count_step(self, sched_out: SchedulerOutput) -> bool:
        """Whether there is a step to run; one that runs is counted and makes the engine busy."""
        if sched_out.is_empty:
            return False
        self._steps += 1
        self._idle_checked = False
        if self.trace is not None:
            self.trace.record(sched_out, len(self.scheduler.running), len(self.scheduler.waiting))
        return True

    def _guarded(self, sched_out: SchedulerOutput, outputs: list[StepOutput], call, what: str = "model step"):
        """call(), or None: a failure fails the step's requests (their outputs join `outputs`), not the engine."""
        try:
            return call()
        except Exception as exc:
            logger.exception("%s failed; failing its %d requests", what, len(sched_out.scheduled))
            outputs += self._fail_step(sched_out, exc)
            return None

    def _idle_check(self, outputs: list[StepOutput]) -> list[StepOutput]:
        if self._inflight is None and self._unsampled is None and not self.completions:
            self._check_idle()  # idle now: the step that ended the last request
        return outputs

    def _finish(self, inflight: tuple[SchedulerOutput, StepHandle], next_step: StepHandle | None = None
                ) -> list[StepOutput]:
        """Read a launched step's tokens and turn them into outputs. next_step: the step launched after it,
        whose grammar masks start filling as soon as every matcher has consumed these tokens."""
        sched_out, handle = inflight
        try:
            runner_out = self.runner.collect(handle)
        except Exception as exc:
            logger.exception("model step failed; failing its %d requests", len(sched_out.scheduled))
            return self._fail_step(sched_out, exc)
        finally:
            self.clock.lap("collect")
        return self._postprocess(sched_out, runner_out, next_step)

    def _postprocess(self, sched_out: SchedulerOutput, runner_out: RunnerOutput,
                     next_step: StepHandle | None = None) -> list[StepOutput]:
        outputs = []
        completions, logprobs = self.completions.by_id, runner_out.logprobs  # bound once: ~256 requests a step
        if runner_out.prompt_logprobs:
            self.completions.gather_prompt_logprobs(runner_out.prompt_logprobs)
        advanced = None
        if next_step is not None:
            # The next step's masks fill in the mask thread while this step detokenizes (and, pipelined, while
            # the step after is scheduled and staged): 256 rows, ~1.3 ms on an H100 host's 16 cores.
            advanced = self._advance_rows_of(next_step, runner_out.sampled)
            self.runner.start_masks(next_step)
        updated = self.scheduler.update(sched_out, runner_out.sampled)
        self._advance_grammars(updated, advanced)
        self.clock.lap("update")
        for req in updated:
            comp = completions[req.request_id]
            token = req.output_token_ids[-1]
            text = self._detokenize(req, comp.detok, token) if comp.detok else ""
            lp = logprobs.get(req.request_id) if logprobs else None
            # Positional, error=None: keyword arguments cost ~0.1 us apiece, ~256 times a step.
            outputs.append(StepOutput(comp.parent_id, comp.index, [token], text, [lp] if lp else None,
                                      req.finish_reason, req.stop_reason, req.error, len(req.prompt_token_ids),
                                      req.num_cached_tokens))
            if req.error_code is not None:
                outputs[-1].error_code = req.error_code
            if comp.prompt_logprobs is not None:
                outputs[-1].prompt_logprobs, comp.prompt_logprobs = comp.prompt_logprobs, None
            if req.status is FINISHED:
                self.completions.forget(req.request_id)
        self._generation_tokens += len(outputs)
        self.clock.lap("outputs")
        return outputs

    def _advance_rows_of(self, next_step: StepHandle, sampled: dict[str, int]) -> dict[str, bool]:
        """The matchers of the next step's rows consume this step's tokens before scheduler.update, so that its
        masks are asked for that much sooner (update: ~0.3-0.5 ms for 256 rows). Request id -> whether its
        grammar took the token; _advance_grammars judges a refusal once update has said which requests finished."""
        advanced = {}
        for req in next_step.requests:
            token = sampled.get(req.request_id)
            if token is not None and req.grammar is not None:
                advanced[req.request_id] = self._accept_token(req, token)
        return advanced

    def _advance_grammars(self, updated: list[Request], advanced: dict[str, bool] | None = None) -> None:
        """Every constrained request's matcher consumes its new token (unless _advance_rows_of did): in-process
        here in the engine thread (~0.3-0.9 ms for 256 rows; structured.StructuredOutputs.start_fill says why not
        in the mask thread); with the grammar process (engine/grammar_link.py) this only records the tokens for
        the next Step (~0.1 ms)."""
        for req in updated:
            took = advanced.get(req.request_id) if advanced else None
            if took is None and req.grammar is not None:
                took = self._accept_token(req, req.output_token_ids[-1])
            if took is False and not req.is_finished:
                self._refuse_token(req, req.output_token_ids[-1])

    def _accept_token(self, req: Request, token: int) -> bool:
        """Whether the matcher takes the token (a refusal means the mask was bypassed). EOS is allowed only where
        the grammar ends: with ignore_eos the request goes on, unconstrained from there, unless its grammar broke
        (its grammar process was lost: that step's rows allowed every token, EOS included; on an H100 the gated
        engine sampled EOS there once, and the request went on unconstrained)."""
        broken = getattr(req.grammar, "broken", None)  # a grammar process's matcher, known broken before its accept
        if token in req.eos_token_ids and req.sampling_params.ignore_eos and broken is None:
            req.grammar = None
            return True
        return req.grammar.accept(token)

    def _refuse_token(self, req: Request, token: int) -> None:
        """A token the request's grammar refused ends the request with invalid_grammar."""
        why = req.grammar.error()
        logger.warning("request %s: token %d breaks its grammar (%s)", req.request_id, token, why)
        req.error = f"the output cannot follow the request's constraint: {why}"[:300]
        req.error_code = "invalid_grammar"  # the grammar's fault (e.g. too complex to parse), not the server's
        self.scheduler.finish_request(req.request_id, FinishReason.ERROR)

    def _detokenize(self, req: Request, detok: IncrementalDetokenizer, token: int) -> str:
        """The token's text; a stop string in it finishes the request."""
        text, stop_str = detok.add([token])
        if stop_str is not None and not req.is_finished:
            self.scheduler.finish_request(req.request_id, FinishReason.STOP, stop_str)
        elif stop_str is not None:  # the stop string came with the last allowed token: it wins
            req.finish_reason, req.stop_reason = FinishReason.STOP, stop_str
        elif req.is_finished:
            text += detok.flush()
        return text

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[StepOutput]:
        outputs = []
        for sr in sched_out.scheduled:
            rid = sr.request.request_id
            if rid in self.completions.by_id:
                self.scheduler.finish_request(rid, FinishReason.ERROR)
                outputs.append(self.completions.failed(rid, f"model step failed: {type(exc).__name__}"))
        return outputs

    def _check_idle(self) -> None:
        if self.completions or self._idle_checked:
            return
        self._idle_checked = True
        self.runner.device_clock.idle()
        if self.device.type == "cpu":  # the arena's free pages back to the system (engine/malloc.py)
            trim_free_memory()
        leaked = self.scheduler.check_idle_invariant()
        if leaked:
            self._idle_violations += 1
            logger.error("idle invariant violated: %d KV blocks held with no live request", leaked)

    def stats(self) -> EngineStats:
        return EngineStats(self.scheduler.stats(), self._prompt_tokens, self._generation_tokens,
                           self._idle_violations, self._steps, getattr(self.structured, "restarts", 0),
                           self.runner.masked_steps, self.runner.mask_wait_s, self._busy_s,
                           self.clock.totals(), self.runner.device_clock.totals(),
                           list(getattr(self.structured, "worker_s", {}).values()))
