"""Admission of structured-output requests: a request under a grammar is checked when it is added, waits here
while its grammar compiles (off the step loop, in StructuredOutputs' thread), and joins the scheduler at the
first step after the grammar is ready; a grammar that fails to compile fails its request's completions.
No torch here."""
from __future__ import annotations

from collections.abc import Callable, Container
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.request import Request, RequestError, StepOutput, StructuredOutput
from engine.scheduler import Scheduler

if TYPE_CHECKING:
    from engine.structured import StructuredOutputs

IDLE_WAIT_S = 0.005  # how long an otherwise idle step waits for a grammar: short, so new requests are not held


@dataclass
class _Compiling:
    """A structured request's completions, queued once their grammar is compiled."""
    requests: list[Request]
    grammar: Future


class GrammarAdmission:
    """The structured requests whose grammar is compiling, in the order they were added."""

    def __init__(self, structured: StructuredOutputs | None, scheduler: Scheduler) -> None:
        self.structured = structured  # None: the engine runs without a tokenizer, so no grammars
        self.scheduler = scheduler
        self._compiling: list[_Compiling] = []

    def __bool__(self) -> bool:
        """Whether any request waits for its grammar."""
        return bool(self._compiling)

    def add(self, requests: list[Request], constraint: StructuredOutput) -> None:
        """Checked now (RequestError, nothing queued), queued in the scheduler once the grammar is compiled."""
        if self.structured is None:
            raise RequestError("structured outputs need a tokenizer, and this engine runs without one",
                               "unsupported", "structured_outputs")
        self.scheduler.check_fits(requests[0])
        self._compiling.append(_Compiling(requests, self.structured.compile(constraint)))

    def wait_if_idle(self, step_in_flight: bool) -> None:
        """Nothing to run but requests waiting for their grammar: wait for one (briefly), do not spin."""
        if self._compiling and not self.scheduler.has_unfinished() and not step_in_flight:
            wait([c.grammar for c in self._compiling], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def drop(self, request_ids: Container[str]) -> None:
        """Forget these (aborted) requests now, not when their grammar is ready: by then a new request may
        have taken the same id, and must not find the old one admitted beside it."""
        for entry in self._compiling:
            entry.requests = [r for r in entry.requests if r.request_id not in request_ids]
        self._compiling = [entry for entry in self._compiling if entry.requests]

    def admit(self, fail: Callable[[str, str], StepOutput]) -> list[StepOutput]:
        """Queue the requests whose grammar is ready; a failed grammar fails them through `fail(request id,
        message)`."""
        outputs, still = [], []
        for entry in self._compiling:
            if not entry.grammar.done():
                still.append(entry)
                continue
            error = entry.grammar.exception()
            for req in entry.requests:
                if error is None:
                    req.grammar = self.structured.new_grammar(entry.grammar)
                    self.scheduler.add_request(req)
                else:
                    outputs.append(fail(req.request_id, grammar_error_message(error)))
        self._compiling = still
        return outputs


def grammar_error_message(error: BaseException) -> str:
    """The error's own message (a RequestError's), else the grammar error's type."""
    return getattr(error, "message", None) or f"grammar: {type(error).__name__}"
