"""Sampler: processing order, truncation sets, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sampler import Sampler, process_logits, truncate_logits

GREEDY = dict(temperature=0.0)


def req(rid="r", prompt=(1, 2, 3), output=(), eos=(), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=frozenset(eos))
    r.output_token_ids = list(output)
    return r


def kept(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits_row)).flatten().tolist())


# ----------------------------------------------------------------------------- greedy and processing


def test_greedy_is_argmax_and_leaves_the_input_alone():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    before = logits.clone()
    out = Sampler()(logits, [req(f"r{i}", **GREEDY) for i in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    assert torch.equal(logits, before)


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(5, 64)
    reqs = [req(f"r{i}", **(GREEDY if i % 2 == 0 else dict(temperature=1.0))) for i in range(5)]
    out = Sampler()(logits, reqs)
    assert [out.token_ids[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


def test_logit_bias_moves_the_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    assert Sampler()(logits, [req(**GREEDY, logit_bias={2: 10.0})]).token_ids == [2]
    assert Sampler()(logits, [req(**GREEDY, logit_bias={1: -4.0})]).token_ids == [3]
    # Ids outside the vocabulary are ignored rather than crash the step.
    assert Sampler()(logits, [req(**GREEDY, logit_bias={99: 50.0, -1: 50.0})]).token_ids == [1]


def test_logit_bias_only_touches_its_own_row():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    out = Sampler()(logits, [req("a", **GREEDY, logit_bias={0: 9.0}), req("b", **GREEDY)])
    assert out.token_ids == [0, 1]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[1.0, 9.0, 8.0, 7.0, 0.0]])  # 1 = EOS, 2 = stop token, 3 = ordinary
    common = dict(**GREEDY, min_tokens=2, stop_token_ids=[2], logprobs=0)
    out = Sampler()(logits, [req(eos=[1], output=[4], **common)])
    assert out.token_ids == [3]
    # EOS and the stop token carry no mass: token 3 competes with tokens 0 and 4 only.
    expected = 7.0 - math.log(math.exp(1.0) + math.exp(7.0) + math.exp(0.0))
    assert out.logprobs[0].logprob == pytest.approx(expected, abs=1e-6)
    assert Sampler()(logits, [req(eos=[1], output=[4, 4], **common)]).token_ids == [1]


def test_min_tokens_with_ignore_eos_leaves_eos_alone_but_masks_stop_tokens():
    logits = torch.tensor([[1.0, 9.0, 10.0, 7.0]])
    r = req(eos=[1], **GREEDY, min_tokens=3, stop_token_ids=[2], ignore_eos=True)
    assert Sampler()(logits, [r]).token_ids == [1]


def test_penalties_match_a_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # Prompt has token 0; output has token 1 twice and token 2 once.
    r = req(prompt=[0], output=[1, 1, 2], **GREEDY, repetition_penalty=2.0, frequency_penalty=0.5,
            presence_penalty=0.25)
    # Repetition over prompt + output: 2/2, -1*2, 0.5/2; then -0.5*count - 0.25 over output tokens.
    expected = torch.tensor([[1.0, -2.0 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, 3.0, -2.0]])
    torch.testing.assert_close(process_logits(logits, [r]), expected)
    # The sampler's logprobs are those of the processed logits.
    lp = Sampler()(logits, [req(prompt=[0], output=[1, 1, 2], **GREEDY, repetition_penalty=2.0,
                                frequency_penalty=0.5, presence_penalty=0.25, logprobs=5)]).logprobs[0]
    ref = torch.log_softmax(expected[0], -1)
    assert [t for t, _ in lp.top] == ref.argsort(descending=True).tolist()
    assert [v for _, v in lp.top] == pytest.approx(ref.sort(descending=True).values.tolist(), abs=1e-6)


def test_penalties_are_per_row_and_presence_penalty_can_flip_the_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0], [3.0, 2.5, 0.0]])
    penalized = req("a", output=[0], **GREEDY, presence_penalty=1.0)
    plain = req("b", output=[0], **GREEDY)
    assert Sampler()(logits, [penalized, plain]).token_ids == [1, 0]


def test_negative_frequency_penalty_rewards_repeats():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    assert Sampler()(logits, [req(output=[1, 1], **GREEDY, frequency_penalty=-0.5)]).token_ids == [1]


# ----------------------------------------------------------------------------- truncation


PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]
PERM = [3, 0, 4, 1, 2]  # token PERM[j] has probability PROBS[j]: the kept set is not just the low ids


def permuted_logits() -> torch.Tensor:
    logits = torch.empty(len(PROBS))
    logits[PERM] = torch.tensor(PROBS).log()
    return logits


def tokens_of_best(n: int) -> set[int]:
    return set(PERM[:n])


@pytest.mark.parametrize("params,best", [
    (dict(top_k=2), 2),
    (dict(top_k=-1), 5),
    (dict(top_k=0), 5),
    (dict(top_p=0.65), 2),
    (dict(top_p=0.75), 3),
    (dict(top_p=0.3), 1),
    (dict(min_p=0.5), 2),  # threshold 0.2
    (dict(min_p=0.3), 3),  # threshold 0.12
    (dict(top_k=3, top_p=0.8), 2),  # top-p on the renormalized top 3: .47, .35 (sum .82), .18
    (dict(top_k=4, min_p=0.26), 3),  # min_p 0.26 * 0.4 = 0.104 keeps 0.4, 0.3, 0.15
])
def test_truncation_keeps_exactly_the_right_tokens(params, best):
    out = truncate_logits(permuted_logits().unsqueeze(0), [SamplingParams(**params)])
    assert kept(out[0]) == tokens_of_best(best)


def test_truncation_is_per_row_in_one_batch():
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(), SamplingParams(min_p=0.5)]
    out = truncate_logits(permuted_logits().expand(4, -1).clone(), params)
    assert [kept(row) for row in out] == [tokens_of_best(n) for n in (2, 3, 5, 2)]


def test_temperature_sharpens_before_top_p():
    # At temperature 0.5 the probabilities become ~ p^2: .16/.3 = 0.53 for the best, so top_p=0.5 keeps one.
    out = truncate_logits(permuted_logits().unsqueeze(0), [SamplingParams(temperature=0.5, top_p=0.5)])
    assert kept(out[0]) == tokens_of_best(1)


def test_sampling_draws_only_kept_tokens_with_their_probabilities():
    torch.manual_seed(1234)
    n = 4000
    logits = permuted_logits().expand(n, -1).clone()
    out = Sampler()(logits, [req(f"r{i}", top_k=3) for i in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(PROBS)).float() / n
    assert set(out.token_ids) == tokens_of_best(3)
    for j in range(3):
        assert counts[PERM[j]].item() == pytest.approx(PROBS[j] / 0.85, abs=0.03)


# ----------------------------------------------------------------------------- seeds


def run_steps(sampler: Sampler, batch_of_step, steps: int, watch: str) -> list[int]:
    """Feed the same logits for `steps` steps; return the tokens of request `watch`."""
    torch.manual_seed(99)
    logits_row = torch.randn(256)
    tokens = []
    for _ in range(steps):
        reqs = batch_of_step()
        out = sampler(logits_row.expand(len(reqs), -1).clone(), reqs)
        tokens.append(out.token_ids[[r.request_id for r in reqs].index(watch)])
    return tokens


def test_seeded_row_is_reproducible_whatever_the_batch():
    seeded = lambda rid="s", seed=42: req(rid, temperature=1.5, top_p=0.95, seed=seed)  # noqa: E731
    alone = run_steps(Sampler(), lambda: [seeded()], 8, "s")
    crowd = lambda: [req("u1", temperature=1.0), seeded("x", 7), req("g", **GREEDY), seeded(),  # noqa: E731
                     req("u2", temperature=0.7, top_k=5)]
    assert run_steps(Sampler(), crowd, 8, "s") == alone
    last = lambda: [seeded("y", 8), req("u3", temperature=2.0), seeded()]  # noqa: E731
    assert run_steps(Sampler(), last, 8, "s") == alone
    assert len(set(alone)) > 1  # the draw really is random


def test_different_seeds_give_different_tokens():
    a = run_steps(Sampler(), lambda: [req("s", temperature=1.0, seed=1)], 12, "s")
    b = run_steps(Sampler(), lambda: [req("s", temperature=1.0, seed=2)], 12, "s")
    assert a != b


def test_free_drops_the_generator_so_the_sequence_restarts():
    sampler = Sampler()
    batch = lambda: [req("s", temperature=1.0, seed=5)]  # noqa: E731
    first = run_steps(sampler, batch, 6, "s")
    assert run_steps(sampler, batch, 6, "s") != first  # the generator carried on
    sampler.free("s")
    assert run_steps(sampler, batch, 6, "s") == first
    sampler.free("never-seen")  # no error


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_before_temperature_with_top_k_best_first():
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    reqs = [req("a", temperature=0.5, top_k=3, logprobs=4), req("b", **GREEDY), req("c", **GREEDY, logprobs=0)]
    out = Sampler()(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    a, b, c = out.logprobs
    assert b is None
    assert a.token_id == out.token_ids[0]
    assert a.logprob == pytest.approx(ref[0, a.token_id].item(), abs=1e-6)
    vals, ids = ref[0].topk(4)
    assert [t for t, _ in a.top] == ids.tolist()
    assert [v for _, v in a.top] == pytest.approx(vals.tolist(), abs=1e-6)
    assert all(x[1] >= y[1] for x, y in zip(a.top, a.top[1:]))
    assert c.top == [] and c.token_id == out.token_ids[2] == logits[2].argmax().item()
    assert c.logprob == pytest.approx(ref[2].max().item(), abs=1e-6)
    assert math.isclose(sum(math.exp(v) for v in ref[0].tolist()), 1.0, rel_tol=1e-5)


# ----------------------------------------------------------------------------- before the grammar masks
def _masked(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(banned, float("-inf"))


@pytest.mark.parametrize("seed", range(5))
def test_presampled_scores_under_the_masks_pick_the_tokens_of_sampling_the_masked_logits(seed):
    """Sampler.presample runs before a constrained step's masks are filled; masking its scores then taking the
    argmax must give the very tokens (same draws, same order) that masking the logits and sampling them gives:
    greedy, unseeded and seeded rows, every row or only some constrained."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 300, generator=gen).to(torch.bfloat16)
    banned = torch.rand(6, 300, generator=gen) < 0.9
    banned[1] = False  # an unconstrained row in the batch
    kinds = [GREEDY, dict(temperature=0.7), dict(temperature=1.0, seed=7), GREEDY, dict(temperature=1.3),
             dict(temperature=0.5, seed=11)]
    requests = [req(f"r{i}", **k) for i, k in enumerate(kinds)]
    torch.manual_seed(seed)
    expected = Sampler().sample_on_device(_masked(logits, banned), requests)[0]
    torch.manual_seed(seed)
    scores = Sampler().presample(logits, requests)
    assert scores.dtype == torch.float32
    assert torch.equal(_masked(scores, banned).argmax(dim=-1), expected)
    assert not banned[torch.arange(6), expected].any()  # and no banned token won


def test_an_all_greedy_batch_is_presampled_as_its_own_logits():
    """All rows greedy: the masks go on the logits in the model dtype (no float32 copy), and their argmax is the
    token of masking the logits and sampling them."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=gen).to(torch.bfloat16)
    banned = torch.rand(4, 300, generator=gen) < 0.9
    requests = [req(f"g{i}", **GREEDY) for i in range(4)]
    expected = Sampler().sample_on_device(_masked(logits, banned), requests)[0]
    scores = Sampler().presample(logits, requests)
    assert scores is logits
    assert torch.equal(_masked(scores, banned).argmax(dim=-1), expected)


@pytest.mark.parametrize("params", [dict(logprobs=2), dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1),
                                    dict(logit_bias={3: 1.0}), dict(min_tokens=2), dict(repetition_penalty=1.2)])
def test_rows_that_need_the_masked_logits_are_not_presampled(params):
    """Truncation and logprobs are computed from the masked distribution; processing from the request's history,
    which the step ahead does not have yet: such a batch is sampled after its masks, as before."""
    requests = [req("a", **GREEDY), req("b", temperature=1.0, **params)]
    assert Sampler().presample(torch.randn(2, 50), requests) is None
