"""Sampler: logits of a batch of requests -> one token each (+ logprobs where asked).

Order of processing (vLLM's): logit_bias, min_tokens, repetition / frequency / presence penalties,
[logprobs are taken here], then greedy argmax or temperature -> top-k -> top-p -> min-p -> sample.

Logprobs are `log_softmax` of the logits after bias / min_tokens / penalties and before temperature,
top-k, top-p and min-p: the model's distribution as the request shaped it, not the truncated one we
sample from (so a token outside top-p still gets a finite logprob in the top-N list).

Every stage works on the whole batch with per-row tensors built once per call, and a stage is skipped
when no row needs it: an all-greedy batch without penalties or logprobs is a single argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request, SamplingParams, TokenLogprob

MIN_TEMPERATURE = 1e-5


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the request did not ask for logprobs


class Sampler:
    """Stateless except for the per-request generators of seeded requests."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        tokens, token_lp = self.sample_on_device(logits, requests)
        return self.to_host(tokens, token_lp, [r.sampling_params for r in requests])

    def sample_on_device(self, logits: torch.Tensor, requests: list[Request]
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [n, vocab] -> (tokens [n] int64, log-probs [n, vocab] or None), without waiting for the
        device: the runner launches the next step before it reads these."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), "one logits row per request"
        # Logits stay in the model dtype until a stage computes with them: an all-greedy batch is one argmax
        # over bfloat16 (the same token as over its exact float32 copy), not a cast of [n, vocab] first.
        logits = process_logits(logits, requests)
        params = [r.sampling_params for r in requests]
        tokens = self._choose(logits, requests, params)  # [n] int64 on the logits' device
        if all([p.logprobs is None for p in params]):
            return tokens, None
        return tokens, torch.log_softmax(logits.float(), dim=-1)  # before temperature / truncation

    @staticmethod
    def to_host(tokens: torch.Tensor, token_lp: torch.Tensor | None, params: list[SamplingParams]) -> SamplerOutput:
        if token_lp is None:
            return SamplerOutput(tokens.tolist(), [None] * len(params))
        return SamplerOutput(*gather_logprobs(token_lp, tokens, params))

    def _choose(self, logits: torch.Tensor, requests: list[Request], params: list[SamplingParams]) -> torch.Tensor:
        random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]  # not greedy (no property call)
        if not random_rows:
            return logits.argmax(dim=-1)
        if len(random_rows) == len(params):
            return self._sample(logits, requests)
        tokens = logits.argmax(dim=-1)
        rows = to_device(random_rows, logits.device)
        tokens[rows] = self._sample(logits[rows], [requests[i] for i in random_rows])
        return tokens

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Random rows only. logits [m, vocab] -> tokens [m]."""
        return self._race(logits, requests).argmax(dim=-1)

    def _race(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Random rows only. logits [m, vocab] -> float32 scores [m, vocab] whose argmax is each row's token."""
        params = [r.sampling_params for r in requests]
        logits = truncate_logits(logits, params)  # float32 [m, vocab], -inf where cut
        q = self._exponentials(logits, requests)  # [m, vocab]
        # Exponential race: argmax(p / q), q ~ Exp(1), picks token i with probability p_i. It lets each
        # row draw from its own generator, so a seeded row never depends on its batch neighbours. In logs,
        # argmax(logits - log q) is the same token without a softmax pass over the vocabulary.
        return logits.sub_(q.log_())

    def presample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
        """A constrained step's sampling up to the grammar masks, queued before they are filled: scores [n, vocab]
        whose argmax under the masks is each row's token (greedy rows their logits, random rows the race's
        logits / T - log q, drawn as _choose would): float32, or for an all-greedy batch the logits themselves
        (no copy: the masks then go on half the bytes). A mask only sets -inf, which every operation here
        keeps, so masking the scores picks the token masking the logits would. None where a row needs the
        masked logits themselves: logprobs, top-k, top-p, min-p, logit_bias, min_tokens, penalties.
        Through the server at W-B json 100% the sampling queued after the masks kept the device waiting for the
        host ~1.2 ms a step against ~0.4 ms at json 0% (docs/benchmarks.md, eleventh session)."""
        params, vocab = [r.sampling_params for r in requests], logits.shape[1]
        if any([p.logprobs is not None or p.logit_bias or p.min_tokens or _has_penalty(p) or 0 < p.top_k < vocab
                or p.top_p < 1.0 or p.min_p > 0.0 for p in params]):
            return None
        random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if not random_rows:  # the logits themselves: the argmax over the model dtype is _choose's
            return logits
        if len(random_rows) == len(params):
            return self._race(logits, requests)
        scores = logits.float()  # some rows greedy, some random
        rows = to_device(random_rows, logits.device)
        scores[rows] = self._race(logits[rows], [requests[i] for i in random_rows])
        return scores

    def _exponentials(self, like: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        q = torch.empty_like(like)
        seeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is not None]
        if len(seeded) < len(requests):
            q.exponential_()  # unseeded rows share one draw from the default generator
        for i in seeded:
            q[i].exponential_(generator=self._generator(requests[i], like.device))
        # exponential_ may return exactly 0, whose log is -inf: that token would win whatever its logit.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    def _generator(self, request: Request, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(request.sampling_params.seed)
            self._generators[request.request_id] = gen
        return gen


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values -> a tensor on `device`, through pinned memory so the copy does not wait for the GPU."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


# ----------------------------------------------------------------------------- logits processing


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logit_bias, min_tokens, penalties. Returns `logits` itself when nothing applies, else a float32 copy."""
    params = [r.sampling_params for r in requests]
    # One pass first: most batches have no bias, min_tokens or penalty at all (a row with min_tokens 0
    # never needs the min_tokens mask).
    if not any([p.logit_bias or p.min_tokens or _has_penalty(p) for p in params]):
        return logits
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    min_rows = [i for i, r in enumerate(requests) if len(r.output_token_ids) < r.sampling_params.min_tokens]
    pen_rows = [i for i, p in enumerate(params) if _has_penalty(p)]
    if not (bias_rows or min_rows or pen_rows):
        return logits
    logits = logits.to(torch.float32, copy=True)  # the caller's logits stay untouched
    if bias_rows:
        apply_logit_bias(logits, bias_rows, params)
    if min_rows:
        apply_min_tokens(logits, min_rows, requests)
    if pen_rows:
        apply_penalties(logits, pen_rows, requests)
    return logits


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_logit_bias(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    vocab = logits.shape[1]
    pairs = [(i, t, b) for i in rows for t, b in params[i].logit_bias.items() if 0 <= t < vocab]
    if not pairs:
        return
    r, t, b = zip(*pairs)
    dev = logits.device
    logits.index_put_((to_device(r, dev), to_device(t, dev)), to_device(b, dev, logits.dtype), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
    """Until min_tokens are out, the tokens that would end the request cannot be sampled."""
    vocab = logits.shape[1]
    pairs = []
    for i in rows:
        p = requests[i].sampling_params
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(requests[i].eos_token_ids))
        pairs.extend((i, t) for t in banned if 0 <= t < vocab)
    if pairs:
        r, t = zip(*pairs)
        logits[to_device(r, logits.device), to_device(t, logits.device)] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
    """Repetition penalty (HF: over prompt + output, divide positive logits, multiply negative ones);
    frequency and presence penalties (OpenAI: over output tokens, subtract count * f + (count > 0) * p)."""
    dev, vocab = logits.device, logits.shape[1]
    sub = [requests[i] for i in rows]
    rows_t = to_device(rows, dev)
    x = logits[rows_t]  # [m, vocab]
    out_counts = token_counts([r.output_token_ids for r in sub], vocab, dev)  # [m, vocab]
    if any(r.sampling_params.repetition_penalty != 1.0 for r in sub):
        rep = to_device([r.sampling_params.repetition_penalty for r in sub], dev).unsqueeze(1)
        seen = token_counts([r.prompt_token_ids for r in sub], vocab, dev) + out_counts > 0
        penalized = torch.where(x > 0, x / rep, x * rep)
        x = torch.where(seen, penalized, x)
    freq = to_device([r.sampling_params.frequency_penalty for r in sub], dev).unsqueeze(1)
    pres = to_device([r.sampling_params.presence_penalty for r in sub], dev).unsqueeze(1)
    x = x - freq * out_counts - pres * (out_counts > 0).to(x.dtype)
    logits[rows_t] = x


def token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float: how many times each token occurs in each sequence."""
    width = max((len(s) for s in seqs), default=0)
    # Pad (and ids out of range) land in an extra column that is dropped.
    ids = torch.full((len(seqs), width), vocab, dtype=torch.int64)
    for i, s in enumerate(seqs):
        if s:
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
    ids = to_device(ids.clamp_(0, vocab), device)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


# ----------------------------------------------------------------------------- truncation


def truncate_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p: removed tokens get -inf. logits [m, vocab] in any float dtype
    -> [m, vocab] float32 (the division reads the model dtype and writes float32: one pass, no cast)."""
    dev, vocab = logits.device, logits.shape[1]
    # A tiny temperature would overflow the division; below this it is greedy in all but name anyway.
    temps = [max(p.temperature, MIN_TEMPERATURE) for p in params]
    temp = to_device(temps, dev, torch.float32).unsqueeze(1)
    logits = logits / temp
    use_k = any(0 < p.top_k < vocab for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dev)
        # inf, not 1.0: float rounding must not let a cumulative sum reach 1 and cut a top_p=1 row's tail.
        top_p = to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params], dev)
        logits = top_k_top_p(logits, k if use_k else None, top_p if use_p else None)
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], dev, torch.float32)
        logits = apply_min_p(logits, min_p)
    return logits


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k best tokens of each row (exactly k, ties broken by sort order), then the smallest
    set of those whose probability sums to >= p. k [m] int64, p [m] float; None: that filter is off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [m, vocab]
    if k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)  # [1, vocab]
        sorted_logits.masked_fill_(ranks >= k.unsqueeze(1), float("-inf"))
    if p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # A token stays when the tokens ranked above it hold less than p; the best always stays, also when p
        # itself is below what float32 holds (a top_p of 1e-46 is 0 here, and 0 >= 0 would drop every token).
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's best. min_p [m]."""
    probs = logits.softmax(dim=-1)  # [m, vocab]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


# ----------------------------------------------------------------------------- logprobs


def gather_logprobs(token_lp: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
                    ) -> tuple[list[int], list[TokenLogprob | None]]:
    """token_lp [n, vocab] log-probs, tokens [n] -> (the tokens as a list, one TokenLogprob per row that
    asked: the chosen token's logprob and the top-k best first). A single device -> host transfer."""
    return read_logprobs(logprob_table(token_lp, tokens, params).tolist(), params)


def logprob_table(token_lp: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What read_logprobs reads, on the device, queued only: the tokens, then per row that asked its chosen
    token's logprob, its top max_k logprobs and their ids, as one float64 tensor (float64 holds token ids
    exactly). The runner copies it to the host with the step, so reading it never waits on the stream (where
    a later step may wait for grammar masks this thread has yet to ask for: engine/mask_gate.py)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    rows_t = to_device(rows, token_lp.device)
    lp = token_lp[rows_t]  # [r, vocab]
    chosen = lp.gather(1, tokens[rows_t].unsqueeze(1))  # [r, 1]
    max_k = max(params[i].logprobs for i in rows)
    top_vals, top_ids = lp.topk(max_k, dim=-1)  # [r, max_k] each (max_k may be 0)
    table = torch.cat([chosen.double(), top_vals.double(), top_ids.double()], dim=1)  # [r, 1 + 2 * max_k]
    return torch.cat([tokens.double(), table.flatten()])


def read_logprobs(host: list[float], params: list[SamplingParams]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logprob_table's values on the host -> (the tokens, one TokenLogprob per row that asked, else None)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    max_k = max(params[i].logprobs for i in rows)
    n, width = len(params), 1 + 2 * max_k
    token_ids = [int(t) for t in host[:n]]
    out: list[TokenLogprob | None] = [None] * n
    for j, i in enumerate(rows):
        row, k = host[n + j * width: n + (j + 1) * width], params[i].logprobs
        top = [(int(t), v) for t, v in zip(row[1 + max_k: 1 + max_k + k], row[1: 1 + k])]
        out[i] = TokenLogprob(token_ids[i], row[0], top)
    return token_ids, out
