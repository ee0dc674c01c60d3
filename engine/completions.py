"""The engine's live completions: a request's n children, each with its detokenizer and the prompt logprobs it
gathers, from the moment the scheduler accepts them until their last output. LLMEngine owns one Completions;
the scheduler owns the Requests. No torch here."""
from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.request import FinishReason, Request, SamplingParams, StepOutput, TokenLogprob, completion_id


def needs_history(params: SamplingParams) -> bool:
    """Whether sampling this request's next token needs all its earlier tokens on the host."""
    return bool(params.min_tokens or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


@dataclass
class Completion:
    """Engine-side state of one of a request's n completions."""
    parent_id: str
    index: int
    detok: IncrementalDetokenizer | None  # None: no text wanted (detokenize=False or no tokenizer)
    needs_history: bool
    # prompt_logprobs: gathered chunk by chunk, sent with the first output token (None: not asked, or sent)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Child:
    """A completion made but not yet registered: registered only once the scheduler accepted the request."""
    request: Request
    completion: Completion


class Completions:
    """Live completions by child request id (`by_id`, read in the step's hot loop), each request's child ids,
    and how many live ones need every earlier token on the host (penalties, min_tokens)."""

    def __init__(self, tokenizer, eos_token_ids, enable_prefix_caching: bool) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.enable_prefix_caching = enable_prefix_caching
        self.by_id: dict[str, Completion] = {}  # child request id -> its state
        self.children: dict[str, list[str]] = {}  # caller's request id -> child ids
        self.num_history = 0  # live completions whose sampling reads every earlier token

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def make(self, request_id: str, index: int, prompt: list[int], params: SamplingParams) -> Child:
        child_params = params.for_child(index) if params.n > 1 else params
        child_id = completion_id(request_id, index, params.n)
        # Siblings wait for completion 0's prompt so they share its blocks through the prefix cache.
        wait = f"{request_id}#0" if index > 0 and self.enable_prefix_caching else None
        req = Request(child_id, list(prompt), child_params, self.eos_token_ids, wait_for_prefill_of=wait)
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, child_params)
        comp = Completion(request_id, index, detok, needs_history(child_params))
        if params.prompt_logprobs is not None:
            comp.prompt_logprobs = []
        return Child(req, comp)

    def register(self, request_id: str, children: list[Child]) -> None:
        for child in children:
            self.by_id[child.request.request_id] = child.completion
            self.num_history += child.completion.needs_history
        self.children[request_id] = [c.request.request_id for c in children]

    def child_ids(self, request_id: str) -> list[str]:
        """Every live completion of `request_id`, or the one completion whose id (completion_id) it is."""
        return self.children.get(request_id) or ([request_id] if request_id in self.by_id else [])

    def gather_prompt_logprobs(self, chunks) -> None:
        """Append each chunk's prompt logprobs to its completion's; positions already gathered (a preempted
        request computes its prompt again) are skipped."""
        for rid, chunk in chunks.items():
            comp = self.by_id.get(rid)
            if comp is None or comp.prompt_logprobs is None:
                continue
            have = len(comp.prompt_logprobs) + 1  # the next prompt position wanted
            comp.prompt_logprobs += chunk.logprobs[max(0, have - chunk.start):]

    def forget(self, child_id: str) -> Completion:
        comp = self.by_id.pop(child_id)
        self.num_history -= comp.needs_history
        siblings = self.children.get(comp.parent_id, [])
        if not any(s in self.by_id for s in siblings):
            self.children.pop(comp.parent_id, None)
        return comp

    def final_output(self, child_id: str, reason: FinishReason) -> StepOutput:
        """The completion's last, empty output; the completion is forgotten."""
        comp = self.forget(child_id)
        return StepOutput(comp.parent_id, comp.index, [], "", None, reason)

    def failed(self, child_id: str, message: str) -> StepOutput:
        """The completion's last output: finished with an error, `message`; the completion is forgotten."""
        out = self.final_output(child_id, FinishReason.ERROR)
        out.error = message
        return out
