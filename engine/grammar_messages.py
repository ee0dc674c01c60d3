"""The messages between the engine and its grammar process (engine/grammar_link.py, engine/grammar_worker.py):
small typed structs, msgpack on the wire (msgspec), dispatched by type. No torch here.

What the worker builds its StructuredOutputs from (engine.grammar_worker.WorkerSpec, with the tokenizer) is
pickled into a file named on its command line, not sent here.
Engine -> worker, step socket (the engine thread, one Step in flight at a time): Step per constrained step.
Worker -> engine, step socket: Ready once, then Filled per Step.
Engine -> worker, compile socket: Compile. Worker -> engine, reply socket: Compiled (the engine's receiver
thread resolves the constraint's future).
"""
from __future__ import annotations

import msgspec

from engine.request import StructuredOutput

# The mask engines a worker compiles with (engine/grammar_xgr.py says which takes what).
ENGINES = ("xgrammar", "llguidance")

# The grammar processes' time per constrained step, by part (the slowest shard's, summed over steps:
# GrammarLink.worker_s, kvserve_grammar_worker_seconds): consuming the tokens, filling the masks, the Step's way
# to the process, and how long the engine read the answer after it was sent, counted while the engine waited.
WORKER_TIMES = ("accept", "fill", "Step reaches it", "answer read after it was sent while waiting")


class Ready(msgspec.Struct, tag=True, array_like=True):
    error: str | None = None  # the worker could not start


class Compile(msgspec.Struct, tag=True, array_like=True):
    key: int  # the engine's number for this constraint
    constraint: StructuredOutput
    engine: str = ""  # ENGINES: the one the first shard chose, so every shard masks with it; "": the worker's


class Compiled(msgspec.Struct, tag=True, array_like=True):
    key: int
    error: str | None = None  # engine.request.RequestError's message, when it failed
    code: str | None = None
    param: str | None = None
    engine: str = ""  # ENGINES: which one compiled it


class NewMatcher(msgspec.Struct, array_like=True, gc=False):
    gid: int  # the engine's number for one completion's grammar, never reused
    constraint: StructuredOutput  # compiled already (a Compile came first): the worker's cache has it
    engine: str = ""  # the constraint's Compile.engine: a restarted worker compiles it with the same engine


class Step(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Applied in this order: new matchers, tokens consumed, matchers dropped, then the masks filled."""
    new: list[NewMatcher]
    accept_gids: list[int]  # each of these matchers consumes the token at the same index of accept_tokens
    accept_tokens: list[int]
    drop: list[int]
    fill: list[int]  # row i of the buffer gets the mask of matcher fill[i]; -1: another process's row
    buffer: int
    seq: int  # echoed in the Filled: the engine skips the answer to a step it gave up on
    flag: int = -1  # the shared flag set to seq once the rows are written (engine/mask_gate.py); -1: none


class Filled(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The buffer's rows are written. `broken`: matchers that refused a token or are unknown (their rows allow
    every token), with why; `live`: matchers the worker holds (tests check that none leak)."""
    seq: int
    broken: list[int]
    why: list[str]
    live: int
    accept_s: float = 0.0  # the worker's time consuming the step's tokens, then filling its rows: where a
    fill_s: float = 0.0    # constrained step's wait for its masks goes (benchmarks/server_step_profile.py)
    received: float = 0.0  # time.monotonic() (one clock for every process of the host) when the Step was
    answered: float = 0.0  # read, and when this answer was sent

