"""Structured outputs in the engine (offline LLM, tiny random model): constrained rows next to unconstrained ones
leave those token-for-token unchanged; preemption (a tiny KV pool), prefix-cache hits and the async-scheduling
pipeline leave the constrained outputs exactly those of a roomy, synchronous run; aborts while compiling."""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine.llm import LLM
from engine.request import FinishReason, SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["word", "n", "flags"], "additionalProperties": False}
PROMPTS = ["The weather today is", "Once upon a time", "A list of numbers:", "JSON follows"]


def json_params(max_tokens: int = 80, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=StructuredOutput(json=json.dumps(SCHEMA)),
                          **kw)


def run(llm: LLM, prompts, params) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params) for c in o.outputs]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, async_scheduling=False)


@pytest.fixture(scope="module")
def reference(llm):
    """Each request alone, synchronous, a roomy pool: what every other run must equal."""
    free = [run(llm, [p], SamplingParams(temperature=0.0, max_tokens=24))[0] for p in PROMPTS]
    constrained = [run(llm, [p], json_params())[0] for p in PROMPTS]
    return llm.get_tokenizer(), free, constrained


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_unconstrained_rows_unchanged(llm, reference, async_scheduling):
    tok, free, constrained = reference
    llm.engine.async_scheduling = async_scheduling  # the engine reads it every step
    prompts = [p for pair in zip(PROMPTS, PROMPTS) for p in pair]
    params = [SamplingParams(temperature=0.0, max_tokens=24), json_params()] * len(PROMPTS)
    structured, started = llm.engine.structured, []
    real_start = structured.start_fill
    structured.start_fill = lambda *args: started.append(1) or real_start(*args)
    try:
        out = run(llm, prompts, params)
    finally:
        structured.start_fill = real_start
    # Pipelined, a step's masks fill while the previous step detokenizes (engine/engine.py _postprocess).
    assert (len(started) > 10) == async_scheduling
    assert out[0::2] == free
    assert out[1::2] == constrained
    llm.engine.async_scheduling = False
    for ids in out[1::2]:
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), SCHEMA)


def test_preemption_and_prefix_cache_keep_grammar_state(tiny_model_dir, llm, reference):
    """6 blocks of 16 tokens for 4 requests of ~30 tokens (2 blocks each): they preempt each other and are
    recomputed. Then a long prompt twice: the second run starts from the prefix cache."""
    _, _, constrained = reference
    small = LLM(str(tiny_model_dir("llama")), num_kv_blocks=6, max_num_seqs=4)
    assert run(small, PROMPTS, json_params()) == constrained
    assert small.engine.stats().scheduler.num_preemptions > 0
    long_prompt = " ".join(PROMPTS * 4)
    first = llm.generate([long_prompt], json_params())[0]
    again = llm.generate([long_prompt], json_params())[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].finish_reason == "stop"


def test_pipelined_steps_under_preemption_n2_and_aborts(tiny_model_dir, reference):
    """The pipelined loop (async scheduling through the decode graphs' staging) with a pool too small for its
    batch: constrained requests preempt each other and recompute, beside free ones, a sampled n=2 and an
    abort mid-stream. Greedy outputs equal the synchronous, roomy run; the n=2 ones parse; nothing leaks."""
    _, free, constrained = reference
    small = LLM(str(tiny_model_dir("llama")), num_kv_blocks=8, max_num_seqs=6, async_scheduling=True)
    runner = small.engine.runner
    runner.decode_graphs = runner.make_graphs(6, small.engine.max_model_len, None, capture=False)
    eng, tok = small.engine, small.get_tokenizer()
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"c{i}", tok.encode(prompt), json_params())
        eng.add_request(f"f{i}", tok.encode(prompt), SamplingParams(temperature=0.0, max_tokens=24))
    eng.add_request("n2", tok.encode(PROMPTS[1]), SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=80,
                                                                structured=StructuredOutput(json=json.dumps(SCHEMA))))
    eng.add_request("gone", tok.encode(PROMPTS[2]), json_params())
    ids, reasons, steps = {}, {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            ids.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[(o.request_id, o.index)] = o.finish_reason
        steps += 1
        if steps == 6:
            eng.abort_request("gone")
    assert eng.stats().scheduler.num_preemptions > 0
    assert [ids[(f"c{i}", 0)] for i in range(4)] == constrained
    assert [ids[(f"f{i}", 0)] for i in range(4)] == free
    assert reasons[("gone", 0)] == FinishReason.ABORT and FinishReason.ERROR not in reasons.values()
    for index in (0, 1):
        assert reasons[("n2", index)] == FinishReason.STOP
        jsonschema.validate(json.loads(tok.decode(ids[("n2", index)], skip_special_tokens=True)), SCHEMA)
    assert eng.scheduler.stats().num_blocks_used == 0


def test_n3_sampled_and_abort_while_compiling(llm):
    tok = llm.get_tokenizer()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=80,
                                                  structured=StructuredOutput(json=json.dumps(SCHEMA))))
    for c in out[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(c.token_ids, skip_special_tokens=True)), SCHEMA)
    eng = llm.engine
    eng.add_request("gone", tok.encode("x"), SamplingParams(max_tokens=8, structured=StructuredOutput(
        regex="[a-z]{1,40}z")))
    eng.abort_request("gone")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT]
    assert eng.scheduler.stats().num_blocks_used == 0


def test_ignore_eos_goes_on_unconstrained_after_the_grammar_ends(llm):
    """Benchmarks fix output lengths with ignore_eos: the grammar's text comes first, whole, then free tokens."""
    tok = llm.get_tokenizer()
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True,
                                                  structured=StructuredOutput(json=json.dumps(SCHEMA))))
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 60
    value, end = json.JSONDecoder().raw_decode(tok.decode(c.token_ids, skip_special_tokens=True))
    jsonschema.validate(value, SCHEMA)


def test_an_id_reused_while_the_aborted_requests_grammar_compiles(llm):
    """Abort a structured request while its grammar compiles, add a new one under the same id, then let the
    old grammar finish: only the new request runs (one output stream, one scheduler entry), nothing leaks."""
    from concurrent.futures import Future

    eng, tok = llm.engine, llm.get_tokenizer()
    compile_ = eng.structured.compile
    held = Future()  # the first compile: still running until the test says so
    calls = iter([lambda c: held, compile_])
    eng.structured.compile = lambda constraint: next(calls)(constraint)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, structured=StructuredOutput(regex="[a-z]{1,40}z"))
        eng.add_request("again", tok.encode("x"), params)
        eng.abort_request("again")
        eng.add_request("again", tok.encode("y"), params)
        held.set_result(compile_(params.structured).result())  # the aborted request's grammar is ready now
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
            assert eng.scheduler.stats().num_running + eng.scheduler.stats().num_waiting <= 1
    finally:
        eng.structured.compile = compile_
    finished = [o.finish_reason for o in outs if o.finish_reason is not None]
    assert finished == [FinishReason.ABORT, FinishReason.STOP] or finished == [FinishReason.ABORT, FinishReason.LENGTH]
    assert eng.scheduler.stats().num_blocks_used == 0


def _log_calls(obj, name: str, log: list) -> None:
    real = getattr(obj, name)

    def logged(*args, **kwargs):
        log.append(name)
        return real(*args, **kwargs)
    setattr(obj, name, logged)


def test_pipelined_steps_prepare_the_next_step_before_sampling(tiny_model_dir, reference):
    """Async scheduling through the decode graphs' staging (no capture, on the CPU): a constrained step is
    sampled only after the step behind it is scheduled and its inputs staged, its masks fill in the mask
    thread (started before step() returns), and the outputs are those of the synchronous run, constrained
    and free."""
    _, free, constrained = reference
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, async_scheduling=True, max_num_seqs=8)
    runner = llm.engine.runner
    runner.decode_graphs = runner.make_graphs(8, llm.engine.max_model_len, None, capture=False)
    calls: list[str] = []
    for name in ("prepare", "sample", "stage"):
        _log_calls(runner.decode_graphs if name == "stage" else runner, name, calls)
    structured, started = llm.engine.structured, []
    real_start = structured.start_fill
    structured.start_fill = lambda reqs: started.append(len(reqs)) or real_start(reqs)
    eng, filling = llm.engine, []
    real_step = eng.step

    def step():  # whether the launched step's masks were filling when step() returned
        outputs = real_step()
        filling.append(eng._unsampled is not None and eng._unsampled[1].masks is not None)
        return outputs

    eng.step = step
    prompts = [p for pair in zip(PROMPTS, PROMPTS) for p in pair]
    out = run(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=24), json_params()] * len(PROMPTS))
    assert out[0::2] == free and out[1::2] == constrained
    # The next step's masks start filling before step() returns (while the caller sends the outputs).
    assert sum(filling) >= max(len(ids) for ids in constrained) - 2, filling
    order = "".join({"prepare": "p", "sample": "s", "stage": "g"}[c] for c in calls)
    assert order.count("pgs") > 10, order  # prepared (staged in the graph's buffers), then the previous sampled
    assert len(started) >= max(len(ids) for ids in constrained) - 1  # every decode step's masks in the thread
    assert llm.engine.scheduler.stats().num_blocks_used == 0


def test_no_matcher_is_made_while_the_mask_thread_works(tiny_model_dir):
    """The mask thread owns every matcher while it fills: a request admitted then (its
    matcher made) would race it. Under async scheduling, with the thread slowed down, a free request runs
    throughout and short constrained ones arrive two steps in a row, again and again (each first constrained
    step after free ones is where a fill could outlive its step() call): no matcher was made while the thread
    worked, and no request failed. Three arrivals in a row: the third is admitted while the fill that the
    previous step() call started at its end still runs (engine.LLMEngine._step_behind_masks)."""
    import threading
    import time

    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=256, async_scheduling=True, max_num_seqs=8)
    eng, tok, busy, clashes = llm.engine, llm.get_tokenizer(), threading.Event(), []
    structured = eng.structured
    real_job, real_new = structured._fill_rows, structured.new_grammar

    def slow_job(*args):
        busy.set()
        time.sleep(0.02)
        try:
            return real_job(*args)
        finally:
            busy.clear()

    structured._fill_rows = slow_job
    def new_grammar(compiled):  # checked once the matcher is made (new_grammar may wait for the fill first)
        grammar = real_new(compiled)
        clashes.append(busy.is_set())
        return grammar

    structured.new_grammar = new_grammar
    eng.add_request("free", tok.encode(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True))
    finished, added, step = {}, 0, 0
    while eng.has_unfinished_requests():
        if step % 6 in (2, 3, 4) and added < 16:
            eng.add_request(f"c{added}", tok.encode(PROMPTS[added % 4]), json_params(max_tokens=3))
            added += 1
        finished.update({o.request_id: o.finish_reason for o in eng.step() if o.finish_reason is not None})
        step += 1
    assert len(clashes) == added == 16 and not any(clashes), clashes
    assert len(finished) == 17 and FinishReason.ERROR not in finished.values()
    assert eng.scheduler.stats().num_blocks_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_refused_token_ends_the_request_with_an_error(llm, async_scheduling, monkeypatch):
    """A mask that is not applied (a bug's stand-in) lets the model pick a token the grammar refuses: that
    request ends with invalid_grammar, its blocks come back, and the next request is served."""
    eng, tok = llm.engine, llm.get_tokenizer()
    with monkeypatch.context() as bypass:
        bypass.setattr(eng, "async_scheduling", async_scheduling)
        bypass.setattr(eng.structured, "apply", lambda logits, batch: None)
        finished = {}
        for i, prompt in enumerate(PROMPTS[:2]):
            eng.add_request(f"bypassed-{i}", tok.encode(prompt), json_params())
        while eng.has_unfinished_requests():
            finished.update({o.request_id: (o.finish_reason, o.error_code) for o in eng.step() if o.finished})
    assert finished == {f"bypassed-{i}": (FinishReason.ERROR, "invalid_grammar") for i in range(2)}
    assert eng.scheduler.stats().num_blocks_used == 0
    out = llm.generate(PROMPTS[0], json_params())[0].outputs[0]  # served as before
    jsonschema.validate(json.loads(tok.decode(out.token_ids, skip_special_tokens=True)), SCHEMA)


def test_offline_outputs_say_why_a_request_failed(llm, monkeypatch):
    """LLM.generate: a request that ends with an error carries the message and code, not just "error"."""
    with monkeypatch.context() as bypass:
        bypass.setattr(llm.engine.structured, "apply", lambda logits, batch: None)  # the mask bypassed
        out = llm.generate(PROMPTS[2], json_params())[0].outputs[0]
    assert out.finish_reason == "error" and out.error_code == "invalid_grammar"
    assert "cannot follow the request's constraint" in out.error
    ok = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4)).pop().outputs[0]
    assert ok.error is None and ok.error_code is None
