"""LLMEngine: refusals leave nothing behind, aborts and failed steps free everything, seeds are per request."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import FinishReason, RequestError
from engine.setup import resolve_max_num_batched_tokens


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=32, block_size=16, max_model_len=256)


def _drain(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_refused_request_leaves_the_engine_idle(llm):
    engine = llm.engine
    with pytest.raises(RequestError) as e:
        engine.add_request("too-long", [5] * 200, SamplingParams(max_tokens=100, n=2))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError):
        engine.add_request("oov", [engine.vocab_size], SamplingParams())
    assert not engine.has_unfinished_requests()
    engine.add_request("too-long", [5] * 10, SamplingParams(max_tokens=3))  # the id is free again
    assert sum(len(o.new_token_ids) for o in _drain(engine)) == 3


def test_abort_emits_abort_and_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", list(range(100, 160)), SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    engine.step()
    assert engine.stats().scheduler.num_blocks_used > 0
    engine.abort_request("a")
    outs = _drain(engine)
    assert sorted((o.index, o.finish_reason) for o in outs if o.finished) == [(0, FinishReason.ABORT),
                                                                               (1, FinishReason.ABORT)]
    assert engine.stats().scheduler.num_blocks_used == 0


def test_failed_step_fails_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.engine
    real = engine.runner.enqueue
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(out)

    monkeypatch.setattr(engine.runner, "enqueue", flaky)
    engine.add_request("f", [7, 8, 9], SamplingParams(max_tokens=4))
    outs = _drain(engine)
    assert [(o.finish_reason, o.error is not None) for o in outs] == [(FinishReason.ERROR, True)]
    assert engine.stats().scheduler.num_blocks_used == 0
    engine.add_request("g", [7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    assert sum(len(o.new_token_ids) for o in _drain(engine)) == 4


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[11, 12, 13]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([[40, 41], [11, 12, 13], [50] * 30], [others, params, others])
    assert mixed[1].outputs[0].token_ids == alone


def test_async_pipeline_equals_synchronous_steps(tiny_model_dir):
    """The GPU's pipeline (step N+1 scheduled before step N's tokens are read), forced on the CPU, gives the
    same tokens as plain steps, across preemption, chunking, n > 1, seeds, stop tokens and penalties."""
    import random

    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 70))] for _ in range(10)]
    # Without penalties or min_tokens the pipeline runs ahead of the host; with them the engine finishes
    # each step before the next (their sampling reads every earlier token): both must match plain steps.
    pipelined = [SamplingParams(temperature=0, max_tokens=18),
                 SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
                 SamplingParams(temperature=0, max_tokens=16, n=2),
                 SamplingParams(temperature=0.9, seed=3, top_k=50, max_tokens=12),
                 SamplingParams(temperature=0, max_tokens=15, stop_token_ids=[prompts[4][0]])] * 2
    with_history = [SamplingParams(temperature=0.9, seed=3, max_tokens=12, repetition_penalty=1.3),
                    SamplingParams(temperature=0, max_tokens=15, min_tokens=4)] * 5
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(model=str(tiny_model_dir("qwen2")), num_kv_blocks=14, block_size=8, max_num_batched_tokens=24,
                  async_scheduling=async_scheduling)
        out = llm.generate(prompts, pipelined) + llm.generate(prompts, with_history)
        results[async_scheduling] = [[(c.token_ids, c.finish_reason) for c in r.outputs] for r in out]
        assert llm.engine.stats().scheduler.num_preemptions > 0
        assert llm.engine.stats().scheduler.num_blocks_used == 0
    assert results[True] == results[False]


def test_graph_buffers_hold_a_consistent_batch_for_every_size(tiny_model_dir):
    """What each graph's warm-up and capture run on: for every size, the staged padding batch has exactly
    that many tokens (a mixed graph's batch staged for a larger size would run past a smaller graph's
    tensors: an illegal memory access on the GPU)."""
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=8, max_num_batched_tokens=300,
              max_num_seqs=7)
    runner = llm.engine.runner
    for max_tokens in (None, 300):
        graphs = runner.make_graphs(7, llm.engine.max_model_len, max_tokens, capture=False)
        assert len(graphs.sizes) > 2
        for size in sorted(graphs.sizes, reverse=True):  # capture's order
            assert graphs.warm_up(size).shape[0] == size
            meta = graphs._meta(size)  # what the capture that follows reads
            assert int(meta.query_start_loc[-1]) == meta.slot_mapping.shape[0] == size
            assert int((meta.seq_lens - (meta.query_start_loc[1:] - meta.query_start_loc[:-1])).min()) >= 0


def _recording(stage, calls: list):
    """Wrap CudaGraphSteps.stage to record (tokens, longest query) of each step it serves."""
    def recorded(seqs, input_ids, *args):
        calls.append((len(input_ids), max(s.query_len for s in seqs)))
        return stage(seqs, input_ids, *args)
    return recorded


@pytest.mark.parametrize("kinds", [("decode",), ("mixed",), ("decode", "mixed")])
def test_graph_paths_equal_eager_steps(tiny_model_dir, kinds):
    """The CUDA-graph step paths without the capture (packed staging buffers, padding to graph sizes,
    previous-step tokens gathered on the device, mixed graphs' general layout with a padding prompt and
    empty sequences), run on the CPU under the async pipeline, give the tokens and logprobs of plain eager
    steps, across preemption, chunking and n > 1."""
    import random

    rng = random.Random(9)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 40))] for _ in range(9)]
    params = [SamplingParams(temperature=0, max_tokens=14, logprobs=2),
              SamplingParams(temperature=0.8, seed=11, max_tokens=17, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, n=2)] * 3
    results, calls = {}, {kind: [] for kind in kinds}
    for static in (False, True):
        llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=16, block_size=8, max_num_batched_tokens=20,
                  max_num_seqs=7, async_scheduling=static)  # 7: decode batches padded up to sizes 1, 2, 4, 7
        if static:
            runner = llm.engine.runner
            for kind in kinds:  # mixed graphs: every step of <= 20 tokens, padded to 20 tokens in 8 sequences
                graphs = runner.make_graphs(7, llm.engine.max_model_len, 20 if kind == "mixed" else None,
                                            capture=False)
                setattr(runner, f"{kind}_graphs", graphs)
                graphs.stage = _recording(graphs.stage, calls[kind])
        out = llm.generate(prompts, params)
        results[static] = [[(c.token_ids, [lp.logprob for lp in c.logprobs or []], c.finish_reason)
                            for c in r.outputs] for r in out]
        assert llm.engine.stats().scheduler.num_preemptions > 0
        assert llm.engine.stats().scheduler.num_blocks_used == 0
    if "decode" in kinds:
        assert len(calls["decode"]) > 10
        assert {3, 5, 6} & {n for n, _ in calls["decode"]}, "no decode batch needed padding"
    if "mixed" in kinds:
        with_prefills = [(n, q) for n, q in calls["mixed"] if q > 1]
        assert len(with_prefills) > 5 and {n for n, _ in with_prefills} - {20}, "no mixed batch needed padding"
        if "decode" in kinds:  # decode-only steps go to the decode graphs first
            assert all(q > 1 for _, q in calls["mixed"])
    for got, want in zip(results[True], results[False]):
        for (tokens, lps, reason), (want_tokens, want_lps, want_reason) in zip(got, want):
            assert tokens == want_tokens and reason == want_reason
            # Padding changes the float32 matmul shapes, so BLAS blocking differs: ~1e-5 on CI's CPUs.
            assert lps == pytest.approx(want_lps, abs=1e-4)


def test_cpu_packed_weights_give_the_same_greedy_tokens(tiny_model_dir):
    """--cpu-packed-weights (oneDNN-packed matmuls, row counts rounded up to cached shapes): the tokens of
    the plain float32 path, across chunked prefills and decode batches of every size."""
    import random

    from engine.kernels import pack_weight_for_cpu

    if pack_weight_for_cpu(torch.zeros(2, 2)) is None:
        pytest.skip("this torch build lacks oneDNN's linear")
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 60))] for _ in range(11)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for packed in (False, True):
        llm = LLM(model=str(tiny_model_dir("qwen2")), num_kv_blocks=64, block_size=8, max_num_batched_tokens=40,
                  max_num_seqs=6, cpu_packed_weights=packed)
        assert (llm.engine.runner.model.packed_logits_weight is not None) == packed
        outs[packed] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_prepare_inputs_one_token_rows_equal_the_general_path():
    """prepare_inputs' one-token rows (a token of the prompt, of the output, or still in flight) against the
    general path's slice of the request's tokens."""
    from engine.request import Request
    from engine.runner import prepare_inputs
    from engine.scheduler import ScheduledRequest, SchedulerOutput

    def general(out):  # the plain loop the one-token rows are a fast path of
        ids, positions, pending = [], [], []
        for sr in out.scheduled:
            start, end = sr.num_computed_tokens, sr.num_computed_tokens + sr.num_new_tokens
            known = sr.request.token_ids_between(start, end)
            if len(known) < end - start:
                pending.append((len(ids) + end - start - 1, sr.request.request_id))
                known.append(0)
            ids += known
            positions += range(start, end)
        return ids, positions, pending

    req = Request("r", [7, 8, 9], SamplingParams(max_tokens=8), output_token_ids=[0, 11])
    rows = [(0, 2, False), (2, 1, True), (3, 1, True), (4, 1, True), (5, 1, True), (3, 3, True)]
    out = SchedulerOutput([ScheduledRequest(req, start, n, samples) for start, n, samples in rows], 9)
    inputs = prepare_inputs(out)
    assert (inputs.input_ids, inputs.positions, inputs.pending) == general(out)
    assert [(s.context_len, s.query_len) for s in inputs.seqs] == [(start, n) for start, n, _ in rows]
    assert inputs.sample_indices == [2, 3, 4, 5, 8]


def test_step_token_budget_follows_the_device_unless_set(llm):
    """Unset, max_num_batched_tokens is 2048 on the CPU and 8192 on a GPU (vLLM's API-server default on large
    GPUs: one 8k prompt, one prefill step); a value the user set is kept on either."""
    assert llm.engine.max_num_batched_tokens == 2048 and llm.engine.scheduler.max_num_batched_tokens == 2048
    assert resolve_max_num_batched_tokens(None, torch.device("cuda")) == 8192
    assert resolve_max_num_batched_tokens(512, torch.device("cuda")) == 512
    assert resolve_max_num_batched_tokens(16384, torch.device("cpu")) == 16384


def test_prompt_logprobs_of_a_one_token_prompt_are_an_empty_list(llm):
    """Found by the soak: a one-token prompt has no position to score; asked for, its prompt_logprobs are []
    (from the second token on), not None (not asked)."""
    one, two = llm.generate([[500], [500, 501]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert one.outputs[0].prompt_logprobs == [] and len(two.outputs[0].prompt_logprobs) == 1
    plain = llm.generate([[500]], SamplingParams(max_tokens=1))[0]
    assert plain.outputs[0].prompt_logprobs is None


def test_step_trace_has_a_line_per_step_with_its_rows(tiny_model_dir, tmp_path):
    """--step-trace: one line per launched step, pipelined too; its rows, prefill rows and sampling rows
    add up to what the requests did (every generated token sampled once, every prompt prefilled)."""
    from engine.step_trace import read_trace

    path = tmp_path / "trace.csv"
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=16, max_num_batched_tokens=48,
              async_scheduling=True, step_trace=str(path))
    prompts = [list(range(100, 100 + n)) for n in (40, 30, 5)]  # 75 prompt ids: two steps of prefill at least
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    lines = read_trace(str(path))
    assert len(lines) == llm.engine.stats().num_steps >= 4
    assert sum(line["sampling_rows"] for line in lines) == sum(len(r.outputs[0].token_ids) for r in out) == 18
    assert sum(line["tokens"] for line in lines) == 75 + 3 * 5  # each prompt once, then 5 decodes each
    assert lines[0]["prefill_rows"] >= 1 and lines[-1]["prefill_rows"] == 0 and lines[-1]["rows"] >= 1
    assert all(line["tokens"] <= 48 for line in lines)
    assert [line["t_s"] for line in lines] == sorted(line["t_s"] for line in lines)
