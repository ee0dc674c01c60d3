"""Structured outputs with the matchers in a grammar process (engine/grammar_link.py, engine/grammar_worker.py):
the same tokens as the matchers in the engine's process, whatever the scheduler does; no matcher outlives its
request; a killed grammar process fails only the constrained requests, and the next ones are served."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from engine import grammar_link, mask_gate
from engine.grammar_link import GrammarLink, mask_dir
from engine.grammar_messages import WORKER_TIMES
from engine.grammar_xgr import available as xgrammar_available
from engine.llm import LLM
from engine.request import SamplingParams, StructuredOutput
from engine.structured import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["word", "n"], "additionalProperties": False}
PROMPTS = ["The weather today is", "Once upon a time", "A list of numbers:", "JSON follows"]


def json_params(max_tokens: int = 60, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, structured=StructuredOutput(json=json.dumps(SCHEMA)), **kw)


def choice_params() -> SamplingParams:  # llguidance's masks (xgrammar takes schemas and regexes only)
    return SamplingParams(temperature=0.0, max_tokens=10, structured=StructuredOutput(choice=["yes", "no", "maybe"]))


def validate(text: str) -> None:
    import jsonschema  # the test extras have it; the GPU host does not, and its test needs none

    jsonschema.validate(json.loads(text), SCHEMA)


def run(llm: LLM, prompts, params) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params) for c in o.outputs]


@pytest.fixture(scope="module")
def remote(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, structured_outputs_process=True)
    yield llm
    llm.engine.structured.shutdown()


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, structured_outputs_process=False)


@pytest.fixture
def link(remote):
    """A link of its own (4 rows), its worker ready; shut down after the test."""
    from engine.grammar import GrammarLimits

    e = remote.engine
    link = GrammarLink(e.tokenizer, e.vocab_size, e.eos_token_ids, GrammarLimits(), "auto", 4)
    assert link.wait_ready() is None
    yield link
    link.shutdown()


def kill_worker(link: GrammarLink) -> None:
    link.worker.proc.kill()
    link.worker.proc.wait()


def test_the_engine_counts_its_masked_steps_and_their_wait(remote):
    """stats(): a constrained request adds one masked step per token sampled under its mask, and the engine's wait
    for those masks; a free request adds none (both count into the time spent in steps)."""
    before = remote.engine.stats()
    run(remote, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    free = remote.engine.stats()
    assert free.structured_steps == before.structured_steps and free.busy_seconds > before.busy_seconds
    out = run(remote, PROMPTS[:1], choice_params())
    after = remote.engine.stats()
    # "yes" / "no" / "maybe", then EOS. Under async scheduling (CUDA's default) the step after the last token was
    # launched before that token was read: one more step sampled under the mask, its token dropped.
    assert after.structured_steps - free.structured_steps == len(out[0]) + remote.engine.async_scheduling
    assert 0 < after.structured_mask_wait_seconds - free.structured_mask_wait_seconds
    assert after.structured_mask_wait_seconds < after.busy_seconds


def test_the_engine_links_to_a_grammar_process(remote, local):
    assert isinstance(remote.engine.structured, GrammarLink)
    assert type(local.engine.structured) is StructuredOutputs
    assert remote.engine.structured.worker.alive()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_same_tokens_as_in_process_mixed_batch(remote, local, async_scheduling):
    """Constrained (xgrammar and llguidance) rows beside free ones: every output equals the in-process run."""
    prompts = PROMPTS * 2
    params = [json_params(), SamplingParams(temperature=0.0, max_tokens=20), choice_params(),
              json_params(n=2, temperature=0.8, seed=7)] * 2
    for llm in (remote, local):
        llm.engine.async_scheduling = async_scheduling
    try:
        got, want = run(remote, prompts, params), run(local, prompts, params)
    finally:
        remote.engine.async_scheduling = local.engine.async_scheduling = False
    assert got == want
    tok = remote.get_tokenizer()
    for ids, p in zip(got, [p for p in params for _ in range(p.n)]):
        text = tok.decode(ids, skip_special_tokens=True)
        if p.structured is None:
            continue
        if p.structured.json is not None:
            validate(text)
        else:
            assert text in ("yes", "no", "maybe")
    assert_no_matcher_left(remote)


@pytest.fixture(scope="module")
def two_shards(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, structured_outputs_process=True,
              structured_outputs_processes=2, async_scheduling=True)
    yield llm
    llm.engine.structured.shutdown()


def test_two_grammar_processes_share_the_rows(two_shards, local):
    """Two grammar processes, each consuming and filling the rows of its own grammars in one shared bitmask:
    every output equals the in-process run (pipelined), both held matchers, and none is left after."""
    llm, held = two_shards, []
    link = llm.engine.structured
    real = link._collect
    link._collect = lambda pending: held.append([shard.live for shard in link.shards]) or real(pending)
    prompts = PROMPTS * 2
    params = [json_params(), SamplingParams(temperature=0.0, max_tokens=20), choice_params(), json_params()] * 2
    try:
        assert len(link.shards) == 2 and link.shards[1].worker.proc.pid != link.worker.proc.pid
        assert run(llm, prompts, params) == run(local, prompts, params)
        assert any(all(live) for live in held), held  # both processes held matchers at once
        assert_no_matcher_left(llm)
    finally:
        link._collect = real


def test_every_shard_compiles_a_constraint_with_the_first_shards_engine(two_shards):
    """A worker falls back to llguidance where xgrammar fails or outlasts its timeout, which one process can meet
    and another not. The first shard compiles first and its engine goes to the other shards and to the matchers
    (a restarted worker compiles with it too). Here the first shard is told llguidance, as if its xgrammar had
    timed out: the second compiles a schema xgrammar takes with llguidance too, and the outputs are the
    schema's."""
    llm = two_shards
    link, sent = llm.engine.structured, []
    real = link._send_compile

    def send(shard, n, so, engine):
        piece = real(shard, n, so, "llguidance" if shard.index == 0 else engine)
        sent.append((shard.index, piece))
        return piece

    forced = StructuredOutput(json=json.dumps({**SCHEMA, "title": "forced"}))  # a constraint new to both
    link._send_compile = send
    try:
        chosen = link.compile(forced).result(timeout=60)
    finally:
        link._send_compile = real
    assert chosen.engine == "llguidance"
    assert [(index, piece.result().engine) for index, piece in sent] == [(0, "llguidance"), (1, "llguidance")]
    grammar = link.new_grammar(link.compile(forced))
    assert grammar.shard.new[-1].engine == "llguidance"
    del grammar
    tok = llm.get_tokenizer()
    for ids in run(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=60, structured=forced)):
        validate(tok.decode(ids, skip_special_tokens=True))
    if link.args[-1] != "llguidance" and xgrammar_available():  # unforced, a schema is xgrammar's on every shard
        free = link.compile(StructuredOutput(json=json.dumps({**SCHEMA, "title": "free"}))).result(timeout=60)
        assert free.engine == "xgrammar"
    assert_no_matcher_left(llm)


def test_the_next_steps_masks_are_asked_for_before_the_scheduler_reads_the_tokens(tiny_model_dir, local):
    """Pipelined, a step's tokens go to the next step's matchers, and its masks are sent, before
    scheduler.update (the send comes that much sooner): the tokens are the same as the in-process run's, and
    where a step's reading sends masks, it sends them before its update."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, structured_outputs_process=True,
              async_scheduling=True)
    engine, events = llm.engine, []
    spied = {"send": engine.structured, "update": engine.scheduler, "_postprocess": engine}
    for name, owner in spied.items():  # "_postprocess next": reading a step with the next one's masks to ask for
        real = getattr(owner, name)
        setattr(owner, name, lambda *a, real=real, name=name: events.append(
            name + (" next" if a[2:] and a[2] is not None else "")) or real(*a))
    params = [json_params(), SamplingParams(temperature=0.0, max_tokens=20), json_params(), choice_params()]
    try:
        assert run(llm, PROMPTS, params) == run(local, PROMPTS, params)
        triples = list(zip(events, events[1:], events[2:]))
        assert triples.count(("_postprocess next", "send", "update")) > 10, events
        assert ("_postprocess next", "update", "send") not in triples, events
        assert_no_matcher_left(llm)
    finally:
        engine.structured.shutdown()


def test_a_killed_one_of_two_grammar_processes_fails_only_its_grammars(tiny_model_dir, local):
    """SIGKILL the second of two grammar processes mid-run: the constrained requests whose grammars it held
    end with an error, the others finish as in the in-process run without waiting for its replacement to
    start, and the next requests are served."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, structured_outputs_process=True,
              structured_outputs_processes=2)
    link, steps, fifth = llm.engine.structured, [], {}
    real = link.start_fill

    def kill_at_fifth(requests):
        steps.append(1)
        if len(steps) != 5:
            return real(requests)
        os.kill(link.shards[1].worker.proc.pid, signal.SIGKILL)
        link.shards[1].worker.proc.wait()
        start = time.monotonic()
        pending = real(requests)  # the other process's rows go on: no wait for the new one to start
        fifth.update(seconds=time.monotonic() - start, starting=not link.shards[1].worker.ready.is_set())
        return pending

    link.start_fill = kill_at_fifth
    params = json_params(max_tokens=30, ignore_eos=True)
    try:
        want = run(local, PROMPTS, params)
        outs = llm.generate(PROMPTS, params)
    finally:
        link.start_fill = real
    failed = [o.outputs[0].finish_reason == "error" for o in outs]
    assert sum(failed) == 2, failed  # gids 1 and 3 lived in the second process
    assert fifth["starting"] and fifth["seconds"] < 1.0, fifth  # a start takes 3-5 s here
    for o, ids, bad in zip(outs, want, failed):
        assert bad or o.outputs[0].token_ids == ids
    assert link.restarts == 1 and all(shard.worker.alive() for shard in link.shards)
    assert run(llm, PROMPTS[:2], params) == want[:2]
    assert llm.engine.stats().scheduler.num_blocks_used == 0
    link.shutdown()
    assert len(link._workers) == 3 and not any(Path(w.folder).exists() for w in link._workers)  # the killed one's too


def assert_no_matcher_left(llm: LLM) -> None:
    """One more constrained request after the others ended: the worker then holds its matcher alone."""
    run(llm, PROMPTS[:1], json_params(max_tokens=3))
    run(llm, PROMPTS[:1], json_params(max_tokens=3))  # its Step carries the drop of the one before
    assert llm.engine.structured.live == 1


def test_a_step_given_up_on_does_not_mix_its_masks_with_the_next(remote, local):
    """A step whose masks were sent but never read (its step failed before sampling): the next step's masks are
    its own, equal to the in-process fill of the same matchers, and reading the first later gives its own."""
    link, here = remote.engine.structured, local.engine.structured
    so = StructuredOutput(json=json.dumps(SCHEMA))
    remote_rows = [SimpleNamespace(grammar=link.new_grammar(link.compile(so))) for _ in range(3)]
    local_rows = [SimpleNamespace(grammar=here.new_grammar(here.compile(so))) for _ in range(3)]
    opening = remote.get_tokenizer().encode('{"', add_special_tokens=False)
    given_up = link.start_fill(remote_rows)
    for token in opening:  # two rows move on; the third stays at the start
        for r, l in zip(remote_rows[:2], local_rows[:2]):
            assert r.grammar.accept(token) and l.grammar.accept(token)
    got = link.start_fill(remote_rows).result()
    want = here.fill(local_rows)
    assert got.rows == want.rows == [0, 1, 2]
    assert torch.equal(got.bitmask, want.bitmask)
    assert not torch.equal(got.bitmask[0], got.bitmask[2])  # the rows really differ
    assert given_up.result().rows == [0, 1, 2]


def test_a_reserved_steps_matchers_consume_the_tokens_recorded_before_it_is_sent(remote, local):
    """The device-wait order (engine/mask_gate.py): a step's masks are reserved when it is queued, and sent once
    the step before it was read. Tokens accepted in between reach the worker first, so the rows equal the
    in-process fill after the same tokens. Only then is the worker's flag at the step's number."""
    link, here = remote.engine.structured, local.engine.structured
    so = StructuredOutput(json=json.dumps(SCHEMA))
    remote_rows = [SimpleNamespace(grammar=link.new_grammar(link.compile(so))) for _ in range(2)]
    local_rows = [SimpleNamespace(grammar=here.new_grammar(here.compile(so))) for _ in range(2)]
    pending = link.reserve(remote_rows)
    assert pending.sent is None and int(link.flags[0]) < pending.seq
    for token in remote.get_tokenizer().encode('{"', add_special_tokens=False):  # the first row moves on
        assert remote_rows[0].grammar.accept(token) and local_rows[0].grammar.accept(token)
    link.send(pending)
    got, want = pending.result(), here.fill(local_rows)
    assert torch.equal(got.bitmask, want.bitmask) and not torch.equal(got.bitmask[0], got.bitmask[1])
    assert int(link.flags[0]) == pending.seq
    later = link.start_fill(remote_rows)  # numbers go up: a wait for the next step is not met by this one's flag
    assert later.seq > pending.seq
    later.result()
    assert int(link.flags[0]) == later.seq


def test_flags_rise_for_lost_workers_and_released_steps(link):
    """Nothing may leave the device waiting: a step given up before it was sent (release) raises every flag to
    its number, and a lost worker's flag is raised by the link with its rows allowing every token."""
    so = StructuredOutput(json=json.dumps(SCHEMA))
    rows = [SimpleNamespace(grammar=link.new_grammar(link.compile(so)))]
    given_up = link.reserve(rows)
    link.release(given_up)
    assert int(link.flags[0]) == given_up.seq
    kill_worker(link)
    pending = link.reserve(rows)
    batch = pending.result()  # sent here: the worker is gone (a new one starts), its rows allow everything
    assert int(link.flags[0]) == pending.seq
    assert bool((batch.bitmask == -1).all()) and rows[0].grammar.error()
    link.release(pending)  # sent already: nothing to release
    assert int(link.flags[0]) == pending.seq


def test_a_reserved_step_left_unsent_raises_the_flags_and_stops_the_gate(link, monkeypatch):
    """The watch (GrammarLink.watch_reserved): a step sent within STALL_S leaves the flags alone; one reserved
    and never sent (the engine thread stuck waiting for the device) gets every flag raised and `stalled` set."""
    monkeypatch.setattr(grammar_link, "STALL_S", 0.3)
    link.watch_reserved()
    so = StructuredOutput(json=json.dumps(SCHEMA))
    rows = [SimpleNamespace(grammar=link.new_grammar(link.compile(so)))]
    sent = link.start_fill(rows)
    sent.result()
    time.sleep(0.6)
    assert not link.stalled and int(link.flags[0]) == sent.seq
    stuck = link.reserve(rows)
    deadline = time.monotonic() + 5
    while not link.stalled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert link.stalled and int(link.flags[0]) == mask_gate.RELEASED > stuck.seq
    stuck.result()  # sent late: its worker still consumes and fills


def test_a_lost_grammar_fails_its_request_even_at_eos_with_ignore_eos(tiny_model_dir):
    """EOS with ignore_eos drops a request's grammar (it goes on unconstrained), but not a grammar already broken:
    a lost grammar process's rows allowed every token, EOS included, so that request fails like the others
    (the gated engine on an H100 sampled EOS there once, and the request ran on to `length`). An engine of its
    own: the request is finished outside a step."""
    from engine.grammar_process import LOST

    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, structured_outputs_process=True)
    engine = llm.engine
    try:
        engine.add_request("lost", [1, 2, 3], json_params(ignore_eos=True))
        child = engine.completions.children["lost"][0]
        for _ in range(200):  # until its first token: admitted once compiled, its grammar attached
            engine.step()
            req = engine.scheduler.requests.get(child)
            if req is not None and req.output_token_ids:
                break
        assert req.grammar is not None and not req.is_finished
        req.grammar.broken = LOST
        req.output_token_ids.append(next(iter(req.eos_token_ids)))  # as scheduler.update appends it
        engine._advance_grammars([req])
        assert req.is_finished and "grammar process" in req.error
        assert engine.stats().scheduler.num_blocks_used == 0
    finally:
        engine.structured.shutdown()


def test_preemption_with_a_tiny_pool(tiny_model_dir, local):
    """6 blocks of 16 tokens for 4 requests: they preempt each other, the worker's matchers keep their place."""
    small = LLM(str(tiny_model_dir("llama")), num_kv_blocks=6, max_num_seqs=4, structured_outputs_process=True)
    try:
        assert run(small, PROMPTS, json_params()) == run(local, PROMPTS, json_params())
        assert small.engine.stats().scheduler.num_preemptions > 0
    finally:
        small.engine.structured.shutdown()


def test_bad_grammar_is_a_request_error(remote):
    """A grammar the worker cannot compile fails its request with the compile error, fast; the engine goes on."""
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput(grammar="start: undefined_rule"))
    start = time.monotonic()
    out = remote.generate([PROMPTS[0]], bad)[0].outputs[0]
    assert out.finish_reason == "error" and "undefined_rule" in (out.error or "")
    assert time.monotonic() - start < 10
    assert run(remote, PROMPTS[:1], choice_params())


def test_killed_grammar_process_fails_only_constrained_requests(tiny_model_dir):
    """SIGKILL the worker mid-run: the constrained requests end with an error, the free ones finish as they
    would have, and the next constrained request is served by a new worker. One grammar process, whatever the
    host's cores (a 16-core GPU host starts four by default)."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, structured_outputs_process=True,
              structured_outputs_processes=1)
    link = llm.engine.structured
    run_killing_at_fifth(llm, "start_fill")
    tok = llm.get_tokenizer()
    again = run(llm, PROMPTS[:1], json_params())[0]
    validate(tok.decode(again, skip_special_tokens=True))
    assert link.worker.alive() and len(link._workers) == 2
    link.shutdown()


def run_killing_at_fifth(llm: LLM, method: str) -> None:
    """Two free and two constrained requests, the first grammar process SIGKILLed at the fifth call of the link's
    `method`: a constrained request whose grammar it held (or that was compiling) ends with an error; one whose
    grammar lives in another grammar process (a host with more cores runs several) or had ended (its JSON done,
    EOS ignored) goes on to max_tokens; the free ones finish as they did alone; no KV block is left."""
    link = llm.engine.structured
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want_free = run(llm, PROMPTS[:2], free)
    steps, real, spared = [], getattr(link, method), set()

    def kill_at_fifth(arg):
        steps.append(1)
        if len(steps) == 5:
            spared.update(llm.engine.completions.by_id[r.request_id].parent_id
                          for r in llm.engine.scheduler.requests.values() if r.sampling_params.structured
                          and r.output_token_ids and getattr(r.grammar, "shard", None) is not link.shards[0])
            kill_worker(link)
        return real(arg)

    setattr(link, method, kill_at_fifth)
    try:
        outs = llm.generate(PROMPTS[:2] * 2, [free, free, json_params(ignore_eos=True), json_params(ignore_eos=True)])
    finally:
        setattr(link, method, real)
    assert len(steps) >= 5 and len(spared) < 2
    assert [o.outputs[0].token_ids for o in outs[:2]] == want_free
    for o in outs[2:]:
        c = o.outputs[0]
        seen = f"{c.finish_reason}, {len(c.token_ids)} tokens {c.text!r}, error {c.error!r}"
        if o.request_id in spared:
            assert c.finish_reason == "length" and c.error is None and c.text.startswith('{"'), seen
        else:
            assert c.finish_reason == "error" and "grammar process" in c.error, seen
    assert llm.engine.stats().scheduler.num_blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_link_collected_unshut_unpins_its_masks(remote):
    """A link dropped without shutdown() unpins its masks before their mapping goes: a mapping freed while pinned
    left CUDA holding the range, and the next engine mapped there failed (cudaHostRegister 712, then its KV
    allocation raised). Here the masks are kept mapped, so pinning them again succeeds only if the link unpinned."""
    import gc

    from engine.grammar import GrammarLimits

    e = remote.engine
    link = GrammarLink(e.tokenizer, e.vocab_size, e.eos_token_ids, GrammarLimits(), "auto", 4)
    masks, nbytes = link.masks, link.masks.numel() * link.masks.element_size()
    assert link.pinned
    del link
    gc.collect()
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(masks.data_ptr(), nbytes, 0)) == 0
    assert int(cudart.cudaHostUnregister(masks.data_ptr())) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_that_cannot_be_pinned_leave_cuda_working(caplog):
    """A failed registration is CUDA's last error until read: _pin reads it back, so the engine goes on without
    page-locked masks (its warning says their copies wait) instead of failing at its next kernel launch."""
    masks = torch.zeros(1 << 20, dtype=torch.int32)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(masks.data_ptr(), masks.numel() * 4, 0)) == 0
    try:
        assert grammar_link._pin(masks) is False  # already registered: 712
        assert torch.zeros(4, device="cuda").add_(1).sum().item() == 4
        assert "could not page-lock" in caplog.text
    finally:
        cudart.cudaHostUnregister(masks.data_ptr())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_link_is_the_default_and_its_masks_are_page_locked(tiny_model_dir):
    """On CUDA the engine links to a grammar process by itself; the shared masks are page-locked (their copy to
    the device does not wait), the device waits for them (engine/mask_gate.py), and the outputs equal the
    in-process matchers' (the host waiting) under async scheduling: free rows, xgrammar's and llguidance's,
    sampled ones with n=2, and a request with logprobs (sampled after the masks, not presampled)."""
    path = str(tiny_model_dir("llama"))
    linked = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, structured_outputs_wait="device")
    local = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, structured_outputs_process=False)
    link = linked.engine.structured
    assert isinstance(link, GrammarLink) and link.masks.is_pinned()
    assert linked.engine.runner.mask_gate is not None and local.engine.runner.mask_gate is None
    assert linked.engine.async_scheduling and not linked.engine.pipeline_masks
    params = [json_params(), choice_params(), SamplingParams(temperature=0.0, max_tokens=20), json_params(),
              json_params(n=2, temperature=0.8, seed=7), json_params(logprobs=2)] * 2
    prompts = PROMPTS * 3
    got = run(linked, prompts, params)
    assert got == run(local, prompts, params)
    assert linked.engine.stats().structured_steps > 0
    tok = linked.get_tokenizer()
    for ids, p in zip(got, [p for p in params for _ in range(p.n)]):
        if p.structured is not None and p.structured.json is not None:
            validate_if_whole(tok.decode(ids, skip_special_tokens=True))
    assert_no_matcher_left(linked)
    assert linked.engine.stats().scheduler.num_blocks_used == 0
    link.shutdown()


def validate_if_whole(text: str) -> None:
    """The JSON schema's output: valid once it ends; cut by max_tokens, at least a prefix of it."""
    try:
        value = json.loads(text)
    except ValueError:
        assert text.startswith("{"), text
        return
    assert isinstance(value, dict) and set(value) == {"word", "n"}, text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_killed_grammar_process_does_not_leave_the_device_waiting(tiny_model_dir):
    """SIGKILL the grammar process at the fifth step whose masks the device waits for: the link raises the lost
    worker's flag, so the device goes on; the constrained requests fail, the free ones finish as they would,
    and a preemption-heavy run (6 KV blocks) after it equals the host-waiting run."""
    path = str(tiny_model_dir("llama"))
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, structured_outputs_wait="device")
    link = llm.engine.structured
    assert llm.engine.runner.mask_gate is not None
    run_killing_at_fifth(llm, "send")
    link.shutdown()
    small = LLM(path, device="cuda", dtype="float32", num_kv_blocks=6, max_num_seqs=4,
                structured_outputs_wait="device")
    host = LLM(path, device="cuda", dtype="float32", num_kv_blocks=6, max_num_seqs=4)
    try:
        assert small.engine.runner.mask_gate is not None and host.engine.runner.mask_gate is None
        assert run(small, PROMPTS, json_params()) == run(host, PROMPTS, json_params())
        assert small.engine.stats().scheduler.num_preemptions > 0
    finally:
        small.engine.structured.shutdown()
        host.engine.structured.shutdown()


def test_server_survives_its_grammar_process_killed(tiny_model_dir):
    """The real server with --structured-outputs-process: a JSON-schema chat through the official client parses;
    SIGKILL the grammar process (a child of the engine core) while a constrained stream runs: that stream ends
    with an error, a free request beside it completes, the next constrained request is served by a new grammar
    process, no KV block is left used, and SIGTERM then leaves no process behind."""
    import httpx
    import openai
    import psutil
    from server_utils import parse_metrics, start, start_server_process, stop_process

    proc, base = start_server_process(["--model", str(tiny_model_dir("llama")), "--device", "cpu",
                                       "--num-kv-blocks", "128", "--structured-outputs-process",
                                       "--structured-outputs-processes", "1", "--log-level", "warning"])
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}

        def constrained(max_tokens: int = 40) -> str:
            return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=max_tokens,
                                                  messages=[{"role": "user", "content": "hi"}], temperature=0,
                                                  response_format=fmt).choices[0].message.content

        validate(constrained())
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "engine.grammar_worker" in " ".join(p.cmdline())]
        assert len(workers) == 1
        letters = {"prompt": "x", "max_tokens": 300, "temperature": 0, "stream": True,
                   "structured_outputs": {"regex": "[a-z]{400}"}}  # under its mask for every token
        stream = start(base, letters)
        free = start(base, {"prompt": "y", "max_tokens": 300, "ignore_eos": True, "temperature": 0})
        assert stream.first.wait(60)
        workers[0].send_signal(signal.SIGKILL)
        stream.join(60)
        free.join(60)
        assert free.response.status_code == 200
        assert free.response.json()["choices"][0]["finish_reason"] == "length"
        errors = [e for e in stream.events if isinstance(e, dict) and "error" in e]
        assert errors or "error" in stream.finish_reasons, stream.events[-3:]
        validate(constrained())
        metrics = parse_metrics(httpx.get(base + "/metrics").text)
        assert metrics["kvserve_kv_blocks_used"] == 0
        assert metrics["kvserve_grammar_process_restarts_total"] == 1
        steps, waited = metrics["kvserve_structured_steps_total"], metrics["kvserve_structured_mask_wait_seconds_total"]
        assert steps >= 20 and 0 < waited < metrics["kvserve_engine_busy_seconds_total"]  # 3 constrained requests
        sections = {k.split('"')[1]: v for k, v in metrics.items() if k.startswith("kvserve_engine_section_seconds")}
        in_steps = sum(v for k, v in sections.items() if k != "core loop")  # the laps cover each step whole
        assert in_steps == pytest.approx(metrics["kvserve_engine_busy_seconds_total"], rel=0.02, abs=0.005)
        assert sections["mask wait"] >= waited and sections["sample"] > 0 and sections["core loop"] > 0
        worker = {k.split('"')[1]: v for k, v in metrics.items() if k.startswith("kvserve_grammar_worker_seconds")}
        assert set(worker) == set(WORKER_TIMES) and 0 < worker["fill"] < metrics["kvserve_engine_busy_seconds_total"]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert stop_process(proc)[0] == 0
        assert not [p for p in psutil.wait_procs(children, timeout=10)[1]]
    finally:
        if proc.poll() is None:
            stop_process(proc, sig=signal.SIGKILL)


def test_masks_go_to_dev_shm_only_when_it_has_room(tmp_path):
    """A full /dev/shm (Docker's 64 MiB default) would turn a mask write into SIGBUS: then the masks live in a
    file of the temporary directory."""
    import shutil

    free = shutil.disk_usage(tmp_path).free
    assert mask_dir(1 << 20, str(tmp_path)) == str(tmp_path)
    assert mask_dir(free, str(tmp_path)) is None
    assert mask_dir(1 << 20, str(tmp_path / "absent")) is None


class FakeCompiles:
    """A grammar process's compile side without the process: answer_compiles in a thread, its ZeroMQ sockets
    inproc; `worker.compile(constraint)` is what the test gives (engines are not its concern)."""

    def __init__(self, compile_fn) -> None:
        import zmq

        from engine.grammar_worker import answer_compiles

        ctx = zmq.Context.instance()
        self.to_worker, pull, push, self.from_worker = (ctx.socket(t) for t in (zmq.PUSH, zmq.PULL, zmq.PUSH,
                                                                                zmq.PULL))
        tag = f"{os.getpid()}-{id(self)}"
        for a, b, name in ((self.to_worker, pull, "compile"), (push, self.from_worker, "reply")):
            b.bind(f"inproc://kvserve-test-{name}-{tag}")
            a.connect(f"inproc://kvserve-test-{name}-{tag}")
        self.from_worker.setsockopt(zmq.RCVTIMEO, 5000)
        worker = SimpleNamespace(compile=lambda so, engine: compile_fn(so), engine_of=lambda pristine: "llguidance")
        threading.Thread(target=answer_compiles, args=(worker, pull, push), daemon=True).start()

    def send(self, key: int, so: StructuredOutput) -> None:
        from engine.grammar_messages import Compile

        self.to_worker.send(msgspec.msgpack.encode(Compile(key, so)))

    def answer(self):
        from engine.grammar_messages import Compiled

        return msgspec.msgpack.decode(self.from_worker.recv(), type=Compiled)

    def close(self) -> None:
        self.to_worker.close(linger=0)
        self.from_worker.close(linger=0)


def done_future(result=None) -> Future:
    future = Future()
    future.set_result(result)
    return future


def test_the_grammar_process_answers_compiles_as_they_finish():
    """A compile sent after one still compiling (xgrammar took 12 s on `([a-z]{1,30}){1,30}` before the regex
    screen) is answered first; the slow one once it ends. Before, the process answered one at a time."""
    slow = Future()
    fake = FakeCompiles(lambda so: slow if so.regex == "slow" else done_future(object()))
    try:
        fake.send(1, StructuredOutput(regex="slow"))
        fake.send(2, StructuredOutput(regex="ab"))
        assert fake.answer().key == 2
        slow.set_result(object())
        assert fake.answer().key == 1
    finally:
        fake.close()


def test_a_compile_that_cannot_start_is_answered_and_the_next_ones_still_are():
    """The grammar process's compile thread answers a compile whose start raised (a failed answer, not a dead
    thread that would leave every later constraint waiting), then answers the next one."""
    def compile_fn(so):
        if so.regex == "boom":
            raise RuntimeError("cannot schedule new futures after shutdown")
        return done_future(object())

    fake = FakeCompiles(compile_fn)
    try:
        fake.send(1, StructuredOutput(regex="boom"))
        fake.send(2, StructuredOutput(regex="ab"))
        first, second = fake.answer(), fake.answer()
        assert first.key == 1 and "RuntimeError" in first.error and "cannot schedule" in first.error
        assert second.key == 2 and second.error is None
    finally:
        fake.close()


def test_a_compile_waiting_on_a_dead_worker_fails(link):
    """A compile registered with a worker that has died (even after it died) fails within a moment, so no
    request waits forever for its grammar."""
    from concurrent.futures import Future

    from engine.grammar_process import GrammarProcessError

    kill_worker(link)
    time.sleep(0.5)
    late = Future()
    link.worker.compiles[12345] = (late, None)
    with pytest.raises(GrammarProcessError):
        late.result(timeout=5)


def test_a_restart_does_not_stop_the_engine(link, remote):
    """A dead worker is replaced in the background: the compile that finds it dead returns at once (the new
    worker takes seconds to import torch and the tokenizer; the engine used to wait for it, stalling every
    request), its future resolves once the new worker is up, and that worker fills the masks."""
    kill_worker(link)
    start = time.monotonic()
    compiled = link.compile(StructuredOutput(choice=["yes", "no"]))
    returned_after = time.monotonic() - start
    assert link.restarts == 1 and not link.worker.ready.is_set()  # the new worker was still starting
    assert returned_after < 0.5
    rows = [SimpleNamespace(grammar=link.new_grammar(compiled))]  # waits for the compile, so for the worker
    batch = link.fill(rows)
    assert not rows[0].grammar.broken and link.worker.alive()
    allowed = int(sum(bin(w & 0xFFFFFFFF).count("1") for w in batch.bitmask[0].tolist()))
    assert 0 < allowed < remote.engine.vocab_size


def test_a_grammar_process_that_does_not_start_falls_back_to_the_engine_process(tiny_model_dir, monkeypatch,
                                                                                 caplog):
    import sys

    from engine import grammar_process

    monkeypatch.setattr(grammar_process, "WORKER_COMMAND", (sys.executable, "-c", "raise SystemExit(3)"))
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, structured_outputs_process=True)
    assert type(llm.engine.structured) is StructuredOutputs
    assert "did not start" in caplog.text and "exit code 3" in caplog.text
    tok = llm.get_tokenizer()
    assert tok.decode(run(llm, PROMPTS[:1], choice_params())[0], skip_special_tokens=True) in ("yes", "no", "maybe")


def test_a_step_sent_to_a_worker_that_left_does_not_block(link):
    """The worker closed its step channel without dying at once: the send does not block, the worker is killed,
    the step's rows allow every token and its grammars are broken."""
    import socket
    from multiprocessing.connection import Connection

    so = StructuredOutput(choice=["yes", "no"])
    rows = [SimpleNamespace(grammar=link.new_grammar(link.compile(so))) for _ in range(2)]
    ours, theirs = socket.socketpair()
    theirs.close()  # stands in for the worker's end closed
    link.worker.step.close()
    link.worker.step = Connection(ours.detach())
    start = time.monotonic()
    batch = link.start_fill(rows).result()
    assert time.monotonic() - start < 10
    assert bool((batch.bitmask == -1).all()) and all(r.grammar.broken for r in rows)
    assert not link.worker.alive()


def test_the_engine_spins_for_an_answer_and_a_hang_up_ends_the_spin(link, monkeypatch):
    """With a 5 s spin the answer is read once it is there, not after the spin, and the masks equal a blocking
    wait's; a worker killed while the engine spins (stopped first, so it cannot answer) ends the wait at
    once: its rows allow every token and its grammars are broken."""
    monkeypatch.setattr(grammar_link, "POLL_MS", 10_000)  # a spin is capped at the wait's own timeout
    compiled = link.compile(StructuredOutput(choice=["yes", "no"]))
    rows = [SimpleNamespace(grammar=link.new_grammar(compiled)) for _ in range(2)]
    link.spin_s = 0.0
    blocking = link.fill(rows).bitmask.clone()
    link.spin_s = 5.0
    start = time.monotonic()
    spun = link.fill(rows).bitmask.clone()
    assert time.monotonic() - start < 2.0 and torch.equal(spun, blocking)
    assert not bool((blocking == -1).all())  # a real mask: "yes" / "no" only
    os.kill(link.worker.proc.pid, signal.SIGSTOP)
    pending = link.start_fill(rows)
    threading.Timer(0.3, kill_worker, args=(link,)).start()
    start = time.monotonic()
    batch = pending.result()
    assert time.monotonic() - start < 2.0
    assert bool((batch.bitmask == -1).all()) and all(r.grammar.broken for r in rows)


def test_a_failing_step_fails_its_requests_not_the_grammar_process():
    """An exception inside the worker's step (here a matcher's accept raises) breaks that step's grammars, so
    their requests end with an error, and the worker answers as usual instead of dying (a restarted worker
    would fail the same way at every step)."""
    from engine.grammar_messages import Step
    from engine.grammar_worker import Worker

    class Exploding:
        def accept(self, token):
            raise RuntimeError("matcher state corrupted")

    worker = Worker.__new__(Worker)  # the step logic alone, without a process or a tokenizer
    worker.masks, worker.matchers, worker.broken = torch.zeros(2, 4, 3, dtype=torch.int32), {7: Exploding()}, {}
    filled = worker.step(Step([], [7], [1], [], [7, 8, -1], 1, 41))  # row 2: another grammar process's
    assert filled.seq == 41 and filled.broken == [7, 8]
    assert all("matcher state corrupted" in why for why in filled.why)
    assert bool((worker.masks[1, :2] == -1).all()) and bool((worker.masks[0] == 0).all())
    assert bool((worker.masks[1, 2:] == 0).all())  # the other process's row is left to it
    assert set(worker.broken) == {7, 8}


def test_the_grammar_process_exits_with_its_engine(tiny_model_dir):
    """SIGKILL the process that holds the engine (here a child python running an LLM): its grammar process
    exits by itself within seconds, whether it was idle or about to answer."""
    import subprocess
    import sys

    import psutil

    code = ("import sys; from engine.llm import LLM; "
            f"llm = LLM({str(tiny_model_dir('llama'))!r}, num_kv_blocks=64, structured_outputs_process=True); "
            "w = llm.engine.structured.worker; print(w.proc.pid, w.folder, flush=True); sys.stdin.read()")
    engine = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=str(Path(__file__).resolve().parents[1]))
    try:
        pid, folder = engine.stdout.readline().split()
        worker = psutil.Process(int(pid))
        assert worker.is_running() and (Path(folder) / "compile").exists()
        engine.kill()
        engine.wait()
        worker.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its engine
        assert not Path(folder).exists()  # its sockets' folder went with it (the engine could not remove it)
    finally:
        if engine.poll() is None:
            engine.kill()


@pytest.mark.parametrize("cores,asked,want", [(2, None, 1), (16, None, 4), (64, None, 4), (8, None, 2), (16, 3, 3)])
def test_how_many_grammar_processes(monkeypatch, cores, asked, want):
    """One grammar process per 4 host cores, at most 4, unless the configuration names a number."""
    from engine import setup
    from engine.config import EngineConfig

    monkeypatch.setattr(setup, "usable_cores", lambda: cores)
    assert setup.grammar_processes(EngineConfig(model="m", structured_outputs_processes=asked)) == want


@pytest.mark.parametrize("cores,processes,asked,want", [(16, 4, None, 2), (16, 2, None, 4), (2, 4, None, 1),
                                                         (16, 1, None, None), (16, 4, 6, 6)])
def test_fill_threads_per_grammar_process(monkeypatch, cores, processes, asked, want):
    """Half the usable cores shared among the grammar processes, unless --structured-outputs-fill-threads."""
    from engine import grammar_link

    monkeypatch.setattr(grammar_link, "usable_cores", lambda: cores)
    assert grammar_link.fill_threads_per_process(processes, asked) == want


def test_the_fill_threads_option_reaches_the_link_and_the_in_process_matchers(monkeypatch, local):
    from engine import setup
    from engine.config import EngineConfig

    made = {}
    monkeypatch.setattr(setup, "GrammarLink", lambda *args, **kw: made.update(kw) or "link")
    e = local.engine
    config = EngineConfig(model="m", structured_outputs_fill_threads=3, structured_outputs_process=True)
    assert setup.structured_outputs(config, e.tokenizer, e.vocab_size, e.eos_token_ids, e.device) == "link"
    assert made["fill_threads"] == 3 and made["spin_s"] is None  # None: the link's own default
    config = EngineConfig(model="m", structured_outputs_spin_ms=0.5, structured_outputs_process=True)
    setup.structured_outputs(config, e.tokenizer, e.vocab_size, e.eos_token_ids, e.device)
    assert made["spin_s"] == 0.0005
    config = EngineConfig(model="m", structured_outputs_fill_threads=3, structured_outputs_process=False)
    assert setup.structured_outputs(config, e.tokenizer, e.vocab_size, e.eos_token_ids, e.device).fill_threads == 3


@pytest.mark.parametrize("cpu_max,want", [("max 100000\n", 6), ("200000 100000\n", 2), ("50000 100000\n", 1),
                                          (None, 6)])
def test_usable_cores_follow_the_cgroup_quota(tmp_path, monkeypatch, cpu_max, want):
    """A Kubernetes CPU limit (cgroup v2 cpu.max) caps the cores the grammar processes count on."""
    from engine.config import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert usable_cores(str(path)) == want
