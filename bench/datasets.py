"""Benchmark workloads: the random and prefix_repetition datasets as vLLM's `bench serve` draws them, ShareGPT
JSON and our JSONL.

Shared by `kvserve bench serve` (any OpenAI-compatible server) and `kvserve bench throughput` (the engine).
Nothing here imports the engine: a tokenizer is optional and only ever a `transformers` one.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# vLLM's pruning of ShareGPT conversations (is_valid_sequence): too short or too long to be a fair request.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
SYNTHETIC = ("random", "prefix_repetition")  # drawn from token ids: no tokenizer needed


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids sent as they are
    prompt_len: int  # 0 when unknown without a tokenizer (the server's usage fills it in)
    expected_output_len: int


def load_tokenizer(name_or_path: str):
    """A transformers tokenizer from a directory, a hub-style name already cached, or a .gguf file."""
    from transformers import AutoTokenizer

    path = Path(name_or_path)
    if path.suffix == ".gguf" and path.is_file():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(name_or_path)


def _length_bounds(length: int, range_ratio: float, minimum: int) -> tuple[int, int]:
    # vLLM: floor for the low end, ceil for the high end, both inclusive.
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), minimum)
    return low, high


def _decode_to_target_len(tokenizer, token_ids: list[int], target: int, rng: np.random.Generator,
                          max_retry: int = 10) -> tuple[str, int]:
    """Text whose re-encoding has `target` tokens where possible (vLLM's decode / re-encode / trim loop):
    N consecutive ids do not always decode to a string that encodes back to N tokens."""
    for attempt in range(max_retry + 1):
        prompt = tokenizer.decode(token_ids)
        token_ids = tokenizer.encode(prompt, add_special_tokens=False)
        if len(token_ids) == target or attempt == max_retry:
            break
        if len(token_ids) < target:
            token_ids += rng.integers(0, tokenizer.vocab_size, size=target - len(token_ids)).tolist()
        else:
            token_ids = token_ids[:target]
    return prompt, len(token_ids)


def random_requests(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, tokenizer=None, vocab_size: int = 1000) -> list[SampleRequest]:
    """vLLM's random dataset: lengths uniform in [L(1-r), L(1+r)]; prompt i is the run of allowed ids
    (offset_i + i + j) mod |allowed|. With a tokenizer the prompt is decoded to text as vLLM sends it;
    without one it is sent as token ids drawn from [0, vocab_size)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    # The server adds BOS (or similar) when it tokenizes text: leave room for it, as vLLM does.
    num_special = int(tokenizer.num_special_tokens_to_add()) if tokenizer is not None else 0
    in_low, in_high = _length_bounds(max(0, input_len - num_special), range_ratio, 1)
    out_low, out_high = _length_bounds(output_len, range_ratio, 1)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    allowed = _allowed_ids(tokenizer, vocab_size)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else vocab_size
    offsets = rng.integers(0, vocab_size, size=num_requests)
    requests = []
    for i in range(num_requests):
        ids = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        if tokenizer is None:
            requests.append(SampleRequest(ids, len(ids), int(output_lens[i])))
        else:
            prompt, prompt_len = _decode_to_target_len(tokenizer, ids, int(input_lens[i]), rng)
            requests.append(SampleRequest(prompt, prompt_len, int(output_lens[i])))
    return requests


def _allowed_ids(tokenizer, vocab_size: int) -> np.ndarray:
    if tokenizer is None:
        return np.arange(vocab_size)
    return np.array(sorted(set(range(tokenizer.vocab_size)) - set(tokenizer.all_special_ids)))


def prefix_repetition_requests(num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, seed: int = 0, tokenizer=None,
                               vocab_size: int = 1000) -> list[SampleRequest]:
    """vLLM's prefix_repetition dataset: `num_prefixes` random prefixes of `prefix_len` tokens, each the start
    of num_requests / num_prefixes requests whose random suffixes of `suffix_len` tokens differ; every output
    `output_len` tokens; the requests shuffled, so that requests sharing a prefix arrive apart. Token ids
    from [0, vocab_size) without a tokenizer; with one, text (prefix and suffix each decoded as vLLM does),
    the prefix's text the same in every request that shares it."""
    if num_prefixes < 1 or num_requests % num_prefixes:
        raise ValueError(f"--num-prompts ({num_requests}) must be a multiple of --prefix-repetition-num-prefixes "
                         f"({num_prefixes} >= 1)")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("prefix and suffix lengths must be >= 0 with a prompt of >= 1 token; output >= 1")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer, vocab_size)

    def part(length: int) -> tuple[str | list[int], int]:
        ids = allowed[rng.integers(0, len(allowed), size=length)].tolist()
        if tokenizer is None or not length:
            return ("" if tokenizer is not None else ids), length
        return _decode_to_target_len(tokenizer, ids, length, rng)

    requests = []
    for _ in range(num_prefixes):
        prefix, plen = part(prefix_len)
        for _ in range(num_requests // num_prefixes):
            suffix, slen = part(suffix_len)
            requests.append(SampleRequest(prefix + suffix, plen + slen, output_len))
    return [requests[i] for i in rng.permutation(len(requests))]


def _sharegpt_valid(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    return not (prompt_len < SHAREGPT_MIN_LEN or (not fixed_output and output_len < SHAREGPT_MIN_LEN)
                or prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN)


def _oversample(requests: list[SampleRequest], num_requests: int, seed: int) -> list[SampleRequest]:
    # vLLM repeats random picks when the file has fewer usable conversations than asked for.
    if requests and len(requests) < num_requests:
        rnd = random.Random(seed)
        requests = requests + rnd.choices(requests, k=num_requests - len(requests))
    return requests


def sharegpt_requests(path: str | Path, num_requests: int, seed: int = 0, tokenizer=None,
                      output_len: int | None = None) -> list[SampleRequest]:
    """ShareGPT JSON: the first turn is the prompt, the second's length (in tokens) the output length,
    unless `output_len` fixes it. Shuffled with `seed`; pruned as vLLM prunes when lengths are known."""
    if tokenizer is None and output_len is None:
        raise ValueError("ShareGPT needs --tokenizer (to count the reply's tokens) or --sharegpt-output-len")
    with open(path, encoding="utf-8") as f:
        data = [e for e in json.load(f) if len(e.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(data)
    requests: list[SampleRequest] = []
    for entry in data:
        if len(requests) >= num_requests:
            break
        prompt, completion = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        if tokenizer is None:
            requests.append(SampleRequest(prompt, 0, output_len))
            continue
        prompt_len = len(tokenizer(prompt).input_ids)
        out_len = len(tokenizer(completion).input_ids) if output_len is None else output_len
        if _sharegpt_valid(prompt_len, out_len, output_len is not None):
            requests.append(SampleRequest(prompt, prompt_len, out_len))
    return _oversample(requests, num_requests, seed)


def jsonl_requests(path: str | Path, num_requests: int, tokenizer=None) -> list[SampleRequest]:
    """One `{"prompt": str | [token ids], "output_len": N}` a line; the first `num_requests` lines."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(requests) >= num_requests:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            prompt, out_len = row.get("prompt"), row.get("output_len")
            if not isinstance(prompt, (str, list)) or not isinstance(out_len, int) or out_len < 1:
                raise ValueError(f"{path}:{lineno}: need {{'prompt': str or [ints], 'output_len': int >= 1}}")
            if isinstance(prompt, list):
                prompt_len = len(prompt)
            else:
                prompt_len = len(tokenizer(prompt).input_ids) if tokenizer is not None else 0
            requests.append(SampleRequest(prompt, prompt_len, out_len))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", default="random",
                   help="random, prefix_repetition, sharegpt (with --dataset-path), or a PATH.jsonl of "
                        "{prompt, output_len}")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file for --dataset sharegpt")
    g.add_argument("--num-prompts", type=int, default=100, help="number of requests (default 100)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L(1-r), L(1+r)], r in [0, 1)")
    g.add_argument("--random-vocab-size", type=int, default=1000,
                   help="without --tokenizer: random prompts are token ids in [0, this)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fix every ShareGPT request's output length (else the reply's length)")
    p = parser.add_argument_group("prefix_repetition dataset (vLLM's): shared prefixes, different suffixes")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each shared prefix")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="tokens of each request's suffix")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="distinct prefixes; each starts --num-prompts / this many requests")
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)


def requests_from_args(args: argparse.Namespace, tokenizer=None) -> list[SampleRequest]:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed, tokenizer, args.random_vocab_size)
    if args.dataset == "prefix_repetition":
        return prefix_repetition_requests(
            args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.seed, tokenizer,
            args.random_vocab_size)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, tokenizer,
                                 args.sharegpt_output_len)
    if args.dataset.endswith(".jsonl"):
        return jsonl_requests(args.dataset, args.num_prompts, tokenizer)
    raise ValueError(f"--dataset must be random, prefix_repetition, sharegpt or a .jsonl file, "
                     f"got {args.dataset!r}")
