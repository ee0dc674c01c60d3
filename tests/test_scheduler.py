"""Scheduler: chunked prefill, mixed steps, limits, preemption, FCFS, aborts, admission errors, n > 1,
stop conditions; and a hypothesis state machine that checks the block bookkeeping after every step."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_manager import cdiv
from engine.request import FinishReason, Request, RequestError, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

EOS = 0
TOKEN = 7  # an ordinary generated token


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128, caching=True):
    return Scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len, caching)


def make_request(rid, prompt, wait_for=None, **params) -> Request:
    prompt = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    params.setdefault("max_tokens", 16)
    return Request(rid, prompt, SamplingParams(**params), frozenset({EOS}), wait_for_prefill_of=wait_for)


def add(s: Scheduler, rid, prompt, **kw) -> Request:
    r = make_request(rid, prompt, **kw)
    s.add_request(r)
    return r


def step(s: Scheduler, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[Request]]:
    """One step as the engine runs it; every sampling request gets TOKEN unless `tokens` says otherwise."""
    out = s.schedule()
    tokens = tokens or {}
    sampled = {sr.request.request_id: tokens.get(sr.request.request_id, TOKEN) for sr in out.scheduled if sr.samples}
    return out, s.update(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(sr.request.request_id, sr.num_computed_tokens, sr.num_new_tokens) for sr in out.scheduled]


# ---- chunking and mixed steps --------------------------------------------------------------------
def test_long_prompt_is_chunked_over_steps_and_samples_only_at_its_end():
    s = make_scheduler(budget=4)
    r = add(s, "a", 10)
    plans, samples = [], []
    for _ in range(4):
        out = s.schedule()
        plans.append(plan(out))
        samples.append([sr.samples for sr in out.scheduled])  # read before update() appends the token
        s.update(out, {"a": TOKEN} if samples[-1][0] else {})
    assert plans == [[("a", 0, 4)], [("a", 4, 4)], [("a", 8, 2)], [("a", 10, 1)]]
    assert samples == [[False], [False], [True], [True]]
    assert r.output_token_ids == [TOKEN, TOKEN] and r.num_computed_tokens == 11
    assert len(r.block_ids) == cdiv(11, 4)


def test_mixed_step_runs_decodes_and_a_prefill_chunk_prefills_first():
    s = make_scheduler(budget=8)
    add(s, "a", 3)
    add(s, "b", 2)
    step(s)
    add(s, "c", 20)
    out, got = step(s)
    # Running decodes are served first, the newcomer's chunk gets the rest of the budget, and is listed first.
    assert plan(out) == [("c", 0, 6), ("a", 3, 1), ("b", 2, 1)]
    assert out.num_batched_tokens == 8
    assert [r.request_id for r in got] == ["a", "b"]
    out, _ = step(s)
    assert plan(out) == [("c", 6, 6), ("a", 4, 1), ("b", 3, 1)]


def test_budget_and_max_num_seqs_are_respected():
    s = make_scheduler(budget=5, max_num_seqs=2)
    for i in range(4):
        add(s, f"r{i}", 3)
    out, _ = step(s)
    assert plan(out) == [("r0", 0, 3), ("r1", 0, 2)]
    out, _ = step(s)
    # Both seats are taken: r2 waits although budget is left.
    assert plan(out) == [("r0", 3, 1), ("r1", 2, 1)]
    assert out.num_batched_tokens == 2 and s.stats().num_waiting == 2
    s.finish_request("r0", FinishReason.ABORT)
    out, _ = step(s)
    assert plan(out) == [("r2", 0, 3), ("r1", 3, 1)]


# ---- preemption ----------------------------------------------------------------------------------
def test_the_most_recently_admitted_request_is_preempted():
    s = make_scheduler(num_blocks=6, block_size=2, caching=False)
    a, b, c = (add(s, rid, 3, max_tokens=6) for rid in "abc")
    step(s)
    step(s)  # decodes at position 3 still fit in each second block
    assert s.pool.num_free_blocks == 0
    out, _ = step(s)  # a and b need a third block: c goes, b gets one of its blocks
    assert out.preempted_ids == ["c"]
    assert plan(out) == [("a", 4, 1), ("b", 4, 1)]
    assert c.status == RequestStatus.PREEMPTED and c.block_ids == [] and c.num_computed_tokens == 0
    assert c.output_token_ids == [TOKEN, TOKEN] and c.num_preemptions == 1
    assert list(s.waiting) == [c] and s.stats().num_preemptions == 1


def test_a_request_that_is_the_last_one_preempts_itself():
    s = make_scheduler(num_blocks=4, block_size=2, caching=False)
    add(s, "a", 3, max_tokens=5)
    b = add(s, "b", 4, max_tokens=4)
    step(s)
    out, _ = step(s)  # a decodes at position 3 (fits), b at position 4 needs a block: nobody after b
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 3, 1)]
    assert b.status == RequestStatus.PREEMPTED and s.running == [s.requests["a"]]


def test_preempted_request_is_recomputed_with_its_output_and_goes_first_in_line():
    s = make_scheduler(num_blocks=6, block_size=2, caching=False)
    a = add(s, "a", 3, max_tokens=3)
    add(s, "b", 3, max_tokens=6)
    c = add(s, "c", 3, max_tokens=6)
    step(s)
    step(s)
    out, _ = step(s)
    assert out.preempted_ids == ["c"]
    late = add(s, "late", 1, max_tokens=1)  # arrives after c was preempted: must not overtake it
    assert a.is_finished  # its third token: blocks freed
    s.max_num_seqs = 2  # one seat is free for c or late
    out, _ = step(s)
    # c is readmitted first and recomputes prompt + its 2 output tokens in one chunk, then samples.
    assert ("c", 0, 5) in plan(out) and "late" not in [rid for rid, _, _ in plan(out)]
    assert c.output_token_ids == [TOKEN, TOKEN, TOKEN]
    assert c.num_cached_tokens == 0 and late.status == RequestStatus.WAITING


def test_preempted_request_is_recomputed_from_its_cached_prefix():
    s = make_scheduler(num_blocks=4, block_size=2)
    a = add(s, "a", 3, max_tokens=3)
    b = add(s, "b", [1, 2, 3], max_tokens=5)
    step(s)
    step(s)  # b's blocks [1, 2] and [3, TOKEN] are full and registered
    out, _ = step(s)  # a needs a block: b is preempted, its tail block is evicted for a
    assert out.preempted_ids == ["b"] and a.is_finished
    out, _ = step(s)
    # b's head block is still cached: only tokens 2..4 are recomputed.
    assert plan(out) == [("b", 2, 3)]
    assert b.num_cached_tokens == 0  # the count reported to the user is the first admission's


# ---- FCFS, aborts ---------------------------------------------------------------------------------
def test_waiting_requests_are_admitted_in_arrival_order():
    s = make_scheduler(max_num_seqs=1)
    for i in range(3):
        add(s, f"r{i}", 2, max_tokens=1)
    admitted = []
    for _ in range(3):
        out, got = step(s)
        admitted += [rid for rid, _, _ in plan(out)]
        assert [r.finish_reason for r in got] == [FinishReason.LENGTH]
    assert admitted == ["r0", "r1", "r2"] and not s.has_unfinished()


def test_a_request_short_of_blocks_is_not_overtaken():
    s = make_scheduler(num_blocks=4, block_size=2)
    add(s, "a", 3, max_tokens=5)
    step(s)
    add(s, "big", 7, max_tokens=1)  # needs 4 blocks, 2 are free
    add(s, "small", 1, max_tokens=1)  # would fit
    out, _ = step(s)
    assert plan(out) == [("a", 3, 1)]
    assert [r.request_id for r in s.waiting] == ["big", "small"]


def test_abort_frees_everything_and_is_reported_once():
    s = make_scheduler(num_blocks=8, block_size=2)
    a = add(s, "a", 5, max_tokens=4)
    b = add(s, "b", [1, 2, 3, 4, 5], max_tokens=4)
    w = add(s, "w", 3, max_tokens=4)
    s.max_num_seqs = 2  # w stays waiting
    out = s.schedule()  # a and b are scheduled ...
    s.finish_request("a", FinishReason.ABORT)  # ... and a is aborted before the step's tokens come back
    s.finish_request("w", FinishReason.ABORT)
    got = s.update(out, {"a": TOKEN, "b": TOKEN})
    assert got == [b] and a.output_token_ids == [] and a.block_ids == []
    assert a.finish_reason == FinishReason.ABORT and w.status == RequestStatus.FINISHED
    s.finish_request("b", FinishReason.STOP, "a stop string")
    assert b.stop_reason == "a stop string" and not s.has_unfinished()
    assert s.check_idle_invariant() == 0 and s.pool.num_used_blocks == 0
    assert s.pool.num_cached_blocks == 2  # b's two full prompt blocks stay findable
    out = s.schedule()
    assert out.is_empty and sorted(out.finished_ids) == ["a", "b", "w"]
    assert s.schedule().finished_ids == []
    s.finish_request("b", FinishReason.ABORT)  # unknown now: ignored


# ---- admission errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, max_tokens, param", [
    (100, 29, "max_tokens"),  # 129 > max_model_len 128
    (128, 1, "prompt"),
    (128, None, "prompt"),  # without max_tokens the prompt alone must leave room for a token
])
def test_context_length_exceeded(prompt, max_tokens, param):
    s = make_scheduler(max_model_len=128)
    with pytest.raises(RequestError) as e:
        add(s, "a", prompt, max_tokens=max_tokens)
    assert e.value.code == "context_length_exceeded" and e.value.param == param
    assert not s.has_unfinished() and not s.waiting


def test_limits_that_just_fit_are_accepted():
    s = make_scheduler(max_model_len=128)
    add(s, "a", 100, max_tokens=28)
    add(s, "b", 127, max_tokens=None)
    assert len(s.waiting) == 2


@pytest.mark.parametrize("prompt, max_tokens, param", [(8, 9, "max_tokens"), (16, None, "prompt"), (17, 1, "prompt")])
def test_request_that_can_never_fit_in_the_pool_is_refused(prompt, max_tokens, param):
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=128)  # 16 tokens of KV in all
    with pytest.raises(RequestError) as e:
        add(s, "a", prompt, max_tokens=max_tokens)
    assert e.value.code == "context_length_exceeded" and e.value.param == param
    add(s, "b", 8, max_tokens=8)  # exactly the pool


def test_empty_prompt_and_duplicate_ids_are_invalid():
    s = make_scheduler()
    with pytest.raises(RequestError) as e:
        add(s, "a", [])
    assert e.value.code == "invalid_value" and e.value.param == "prompt"
    add(s, "a", 2)
    with pytest.raises(RequestError):
        add(s, "a", 2)


# ---- prefix cache ----------------------------------------------------------------------------------
def test_prefix_cache_hit_at_admission_and_stats():
    s = make_scheduler(block_size=4)
    a = add(s, "a", 10)
    step(s)
    b = add(s, "b", 10)
    out, _ = step(s)
    assert ("b", 8, 2) in plan(out)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert [s.pool.ref_counts[x] for x in a.block_ids[:2]] == [2, 2]
    st_ = s.stats()
    assert (st_.prefix_cache_queries, st_.prefix_cache_hits) == (20, 8)


def test_blocks_are_only_hit_after_the_step_that_computes_them_ran():
    s = make_scheduler(block_size=4)
    add(s, "a", 10)
    b = add(s, "b", 10)  # admitted in the same step as a: a's blocks are not written yet
    out, _ = step(s)
    assert plan(out) == [("a", 0, 10), ("b", 0, 10)] and b.num_cached_tokens == 0


def test_prefix_caching_off():
    s = make_scheduler(block_size=4, caching=False)
    add(s, "a", 10)
    step(s)
    b = add(s, "b", 10)
    out, _ = step(s)
    assert ("b", 0, 10) in plan(out) and b.num_cached_tokens == 0
    assert (s.stats().prefix_cache_queries, s.stats().prefix_cache_hits) == (0, 0)


# ---- n > 1 -----------------------------------------------------------------------------------------
def test_sibling_waits_for_the_prompt_and_then_shares_its_blocks():
    s = make_scheduler(block_size=4, budget=6)
    a = add(s, "x#0", 10)
    b = add(s, "x#1", 10, wait_for="x#0")
    add(s, "other", 2)
    assert plan(step(s)[0]) == [("x#0", 0, 6)]
    # x#0 finishes its prompt this step: x#1 still waits (the K/V is written only when the step runs),
    # and a later request may go past it meanwhile.
    assert plan(step(s)[0]) == [("x#0", 6, 4), ("other", 0, 2)]
    assert b.status == RequestStatus.WAITING
    out, _ = step(s)
    assert plan(out) == [("x#1", 8, 2), ("x#0", 10, 1), ("other", 2, 1)]
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]


def test_sibling_is_not_admitted_in_the_step_that_admits_its_sibling():
    s = make_scheduler(block_size=4)
    add(s, "x#0", 10)
    b = add(s, "x#1", 10, wait_for="x#0")
    assert plan(step(s)[0]) == [("x#0", 0, 10)]
    assert plan(step(s)[0]) == [("x#1", 8, 2), ("x#0", 10, 1)] and b.num_cached_tokens == 8


def test_sibling_of_a_finished_request_is_admitted():
    s = make_scheduler(block_size=4)
    add(s, "x#0", 10)
    add(s, "x#1", 10, wait_for="x#0")
    s.finish_request("x#0", FinishReason.ABORT)
    assert plan(step(s)[0]) == [("x#1", 0, 10)]


# ---- stop conditions --------------------------------------------------------------------------------
def run_until_finished(s: Scheduler, r: Request, tokens: list[int]) -> None:
    for t in tokens:
        assert not r.is_finished
        step(s, {r.request_id: t})


def test_eos_stops_and_frees():
    s = make_scheduler()
    r = add(s, "a", 3)
    run_until_finished(s, r, [5, EOS])
    assert r.finish_reason == FinishReason.STOP and r.stop_reason is None and r.output_token_ids == [5, EOS]
    assert r.block_ids == [] and s.schedule().finished_ids == ["a"]


def test_ignore_eos_and_length():
    s = make_scheduler()
    r = add(s, "a", 3, ignore_eos=True, max_tokens=3)
    run_until_finished(s, r, [EOS, EOS, EOS])
    assert r.finish_reason == FinishReason.LENGTH and len(r.output_token_ids) == 3


def test_stop_token_ids_give_the_stop_reason():
    s = make_scheduler()
    r = add(s, "a", 3, stop_token_ids=[42])
    run_until_finished(s, r, [5, 42])
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == 42


@pytest.mark.parametrize("stop", [EOS, 42])
def test_min_tokens_come_before_any_stop(stop):
    s = make_scheduler()
    r = add(s, "a", 3, min_tokens=2, stop_token_ids=[42])
    run_until_finished(s, r, [stop, stop, stop])
    assert r.finish_reason == FinishReason.STOP and r.output_token_ids == [stop] * 3


def test_max_model_len_ends_a_request_without_max_tokens():
    s = make_scheduler(max_model_len=8)
    r = add(s, "a", 5, max_tokens=None)
    run_until_finished(s, r, [5, 5, 5])
    assert r.finish_reason == FinishReason.LENGTH and r.num_tokens == 8


def test_a_request_without_max_tokens_ends_where_the_pool_ends():
    s = make_scheduler(num_blocks=2, block_size=4, max_model_len=128)
    r = add(s, "a", 5, max_tokens=None)
    run_until_finished(s, r, [5, 5, 5])
    assert r.finish_reason == FinishReason.LENGTH and r.num_tokens == 8


# ---- property: the bookkeeping holds after every step -------------------------------------------------
PREFIXES = [[], [1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]
STOP_TOKEN = 9


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 12),
                max_num_seqs=st.integers(1, 4), budget=st.integers(1, 10), max_model_len=st.integers(4, 24),
                caching=st.booleans())
    def setup(self, block_size, num_blocks, max_num_seqs, budget, max_model_len, caching):
        self.s = Scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len, caching)
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> the prefix its K/V encodes
        self.next_id = 0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 9), max_size=6),
          max_tokens=st.one_of(st.none(), st.integers(1, 8)), min_tokens=st.integers(0, 3),
          ignore_eos=st.booleans(), n=st.integers(1, 3))
    def add(self, prefix, suffix, max_tokens, min_tokens, ignore_eos, n):
        prompt, rid = prefix + suffix, f"r{self.next_id}"
        self.next_id += 1
        min_tokens = min(min_tokens, max_tokens or min_tokens)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                                stop_token_ids=[STOP_TOKEN])
        live_before = len(self.s.requests)
        children = [Request(f"{rid}#{i}", list(prompt), params, frozenset({EOS}),
                            wait_for_prefill_of=f"{rid}#0" if i else None) for i in range(n)]
        try:
            self.s.add_request(children[0])
        except RequestError:
            assert len(self.s.requests) == live_before
            total = len(prompt) + (max_tokens or 1)
            assert not prompt or total > self.s.max_model_len or cdiv(total, self.s.block_size) > self.s.pool.num_blocks
            return
        for child in children[1:]:
            self.s.add_request(child)

    @rule(data=st.data())
    def step(self, data):
        self.mid_step = True  # a failed check leaves a step half done: teardown must not drain then
        before = {rid: (r.status, r.num_computed_tokens) for rid, r in self.s.requests.items()}
        out = self.s.schedule()
        self.check_output(out, before)
        self.check_kv(out)
        sampled = {sr.request.request_id: data.draw(st.sampled_from([EOS, STOP_TOKEN, 3, 5, 7]))
                   for sr in out.scheduled if sr.samples}
        lengths = {rid: len(self.s.requests[rid].output_token_ids) for rid in sampled}
        for r in self.s.update(out, sampled):
            assert len(r.output_token_ids) == lengths[r.request_id] + 1
            self.check_finish(r)
        self.mid_step = False

    def check_output(self, out: SchedulerOutput, before: dict[str, tuple[RequestStatus, int]]):
        s = self.s
        assert out.num_batched_tokens == sum(sr.num_new_tokens for sr in out.scheduled) <= s.max_num_batched_tokens
        assert len(out.scheduled) <= len(s.running) <= s.max_num_seqs
        ids = [sr.request.request_id for sr in out.scheduled]
        assert len(set(ids)) == len(ids) and not set(ids) & set(out.preempted_ids)
        kinds = [sr.num_new_tokens > 1 for sr in out.scheduled]
        assert kinds == sorted(kinds, reverse=True)  # prefills first
        context = {sr.request.request_id: sr.num_computed_tokens for sr in out.scheduled}
        for sr in out.scheduled:
            r = sr.request
            assert r.status == RequestStatus.RUNNING and sr.num_new_tokens >= 1
            assert sr.num_computed_tokens + sr.num_new_tokens == r.num_computed_tokens <= r.num_tokens
            admitted_now = before[r.request_id][0] != RequestStatus.RUNNING
            sibling = s.requests.get(r.wait_for_prefill_of)
            if admitted_now and sibling is not None and s.enable_prefix_caching:
                # n > 1: the sibling's whole prompt was in its context at the start of this step (written by
                # an earlier step, or a cache hit), so the newcomer could find it in the prefix cache.
                sibling_context = context.get(sibling.request_id, sibling.num_computed_tokens)
                assert sibling_context >= sibling.num_prompt_tokens

    def check_kv(self, out: SchedulerOutput):
        """Play the runner: every context position read must hold the K/V of exactly that prefix."""
        def key(r, pos):
            return tuple(r.all_token_ids[:pos + 1])

        def slot(r, pos):
            return r.block_ids[pos // self.s.block_size], pos % self.s.block_size

        for sr in out.scheduled:
            for pos in range(sr.num_computed_tokens):
                assert self.kv.get(slot(sr.request, pos)) == key(sr.request, pos)
        for sr in out.scheduled:
            for pos in range(sr.num_computed_tokens, sr.num_computed_tokens + sr.num_new_tokens):
                self.kv[slot(sr.request, pos)] = key(sr.request, pos)
        for sr in out.scheduled:  # no write of this step landed on a block another request reads
            for pos in range(sr.num_computed_tokens + sr.num_new_tokens):
                assert self.kv.get(slot(sr.request, pos)) == key(sr.request, pos)

    def check_finish(self, r: Request):
        p, out = r.sampling_params, r.output_token_ids
        stop_token = (out[-1] == EOS and not p.ignore_eos) or out[-1] == STOP_TOKEN
        length = (p.max_tokens is not None and len(out) >= p.max_tokens) or r.num_tokens >= self.s.max_seq_len
        should_stop = stop_token and len(out) > p.min_tokens
        assert r.is_finished == (should_stop or length)
        if should_stop:
            assert r.finish_reason == FinishReason.STOP
        elif length:
            assert r.finish_reason == FinishReason.LENGTH

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        r = self.s.requests[rid]
        self.s.finish_request(rid, FinishReason.ABORT)
        assert r.is_finished and r.block_ids == [] and rid not in self.s.requests

    @precondition(lambda self: self.s.running)
    @rule(data=st.data())
    def stop_string(self, data):
        r = data.draw(st.sampled_from(self.s.running))
        self.s.finish_request(r.request_id, FinishReason.STOP, "stop")
        assert r.finish_reason == FinishReason.STOP and r.stop_reason == "stop"

    @invariant()
    def blocks_are_accounted_for(self):
        s, pool = self.s, self.s.pool
        assert pool.num_free_blocks + pool.num_used_blocks + pool.num_cached_blocks == pool.num_blocks
        holders = Counter()
        for r in s.requests.values():
            assert len(set(r.block_ids)) == len(r.block_ids)
            if r.status == RequestStatus.RUNNING:
                assert len(r.block_ids) == cdiv(r.num_computed_tokens, s.block_size)
            else:
                assert r.block_ids == [] and r.num_computed_tokens == 0
            holders.update(r.block_ids)
        assert [pool.ref_counts[b] for b in range(pool.num_blocks)] == [holders[b] for b in range(pool.num_blocks)]
        assert pool.num_used_blocks == len(holders)
        for b, n in holders.items():
            if n > 1:  # shared only through the prefix cache
                assert pool.block_hashes[b] is not None and pool.lookup(pool.block_hashes[b]) == b
        assert len(s.running) + len(s.waiting) == len(s.requests) and len(s.running) <= s.max_num_seqs

    @invariant()
    def idle_means_nothing_held(self):
        if not self.s.has_unfinished():
            assert self.s.check_idle_invariant() == 0 and self.s.pool.num_used_blocks == 0

    def teardown(self):
        """Every request finishes (no deadlock, no livelock), and then no block is held."""
        if not hasattr(self, "s") or getattr(self, "mid_step", False):
            return
        for _ in range(2000):
            if not self.s.has_unfinished():
                break
            out = self.s.schedule()
            self.s.update(out, {sr.request.request_id: 3 for sr in out.scheduled if sr.samples})
        assert not self.s.has_unfinished()
        assert self.s.check_idle_invariant() == 0


SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_scheduler_state_machine = SchedulerMachine.TestCase
