"""LLM.generate: the offline API, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import fields

from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import CompletionOutput, RequestOutput, SamplingParams, StepOutput

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_options) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_options) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        results = [self._add(prompt, p) for prompt, p in zip(prompts, params)]
        by_id = {r.request_id: r for r in results}
        self._run(by_id, sum(p.n for p in params), use_tqdm)
        return results

    def _add(self, prompt: Prompt, params: SamplingParams) -> RequestOutput:
        rid = str(self._next_id)
        self._next_id += 1
        if isinstance(prompt, str) and self.engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (the engine was built with skip_tokenizer_init)")
        token_ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.add_request(rid, token_ids, params)
        outputs = [CompletionOutput(i, "", [], None, logprobs=[] if params.logprobs is not None else None)
                   for i in range(params.n)]
        return RequestOutput(rid, prompt if isinstance(prompt, str) else None, token_ids, outputs, False)

    def _run(self, by_id: dict[str, RequestOutput], num_completions: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_completions, desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if _apply(by_id[delta.request_id], delta):
                    bar.update(1)
        bar.close()


def _apply(result: RequestOutput, delta: StepOutput) -> bool:
    """Fold one delta into its RequestOutput; True when it finished a completion."""
    out = result.outputs[delta.index]
    out.token_ids += delta.new_token_ids
    if delta.new_text:
        out.text += delta.new_text
    if delta.new_logprobs and out.logprobs is not None:
        out.logprobs += delta.new_logprobs
        # Added on to, not summed over every token each step (quadratic): the same additions, in order.
        total = out.cumulative_logprob or 0
        for lp in delta.new_logprobs:
            total += lp.logprob
        out.cumulative_logprob = total
    if delta.prompt_logprobs is not None:  # [] for a one-token prompt: still asked
        out.prompt_logprobs = delta.prompt_logprobs
    if delta.num_cached_tokens > result.num_cached_tokens:
        result.num_cached_tokens = delta.num_cached_tokens
    if delta.finish_reason is None:
        return False
    out.finish_reason = delta.finish_reason.value
    out.stop_reason = delta.stop_reason
    out.error, out.error_code = delta.error, delta.error_code
    result.finished = all(o.finish_reason is not None for o in result.outputs)
    return True


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)
