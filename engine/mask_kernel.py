"""The grammar mask applied to the logits on the GPU, beside its reference (engine/structured.py apply_reference).

Bit j of word w of a mask row clear -> token 32 * w + j of its logits row becomes -inf. xgrammar's Triton
kernel (what vLLM and SGLang call) runs one program per SM that walks (row, 4,096-token block) pairs one
after another: at 256 rows of 151,936 bfloat16 logits it took 0.26-0.28 ms on an H100 (~300 GB/s of the
~78 MB it writes; benchmarks/mask_apply.py, ninth and tenth sessions). Here every (row, block) pair is a
program of its own, so the whole grid is in flight at once, and the constrained rows are named by an index
instead of a full-batch mask built on the device first. It is the one hot loop of this file; the reference
stays the rule. Checked against the reference on random masks: on the CPU through Triton's interpreter
(tests/test_structured_masking.py), on CUDA by the same tests and, at engine start, by self_check (a failure
or a mismatch keeps xgrammar's kernel).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 2048  # tokens a program masks: 64 mask words


if triton is not None:
    @triton.jit
    def _apply_mask(logits_ptr, mask_ptr, rows_ptr, vocab, logits_stride, mask_stride,
                    HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)  # the mask row
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab
        if HAS_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        words = tl.load(mask_ptr + i.to(tl.int64) * mask_stride + tokens // 32, mask=inside, other=-1)
        banned = ((words >> (tokens % 32)) & 1) == 0
        tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=inside & banned)


def available() -> bool:
    return triton is not None


def apply_mask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """logits [batch, vocab] in place; mask [m, words] int32 on the logits' device; rows: the m logits rows the
    mask rows belong to (int64 on the device), None for rows 0..m-1."""
    m, vocab = mask.shape[0], min(logits.shape[1], mask.shape[1] * 32)
    assert logits.stride(1) == 1 and mask.stride(1) == 1, "rows must be contiguous"
    if m == 0:
        return
    grid = (m, triton.cdiv(vocab, BLOCK))
    _apply_mask[grid](logits, mask, mask if rows is None else rows, vocab, logits.stride(0), mask.stride(0),
                      HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=4)


def self_check(device: torch.device, dtype: torch.dtype, vocab: int) -> str | None:
    """None if apply_mask equals the reference on random masks (every row, and some rows out of order) on
    `device`; else why not (the caller then keeps xgrammar's kernel)."""
    from engine.structured import MaskBatch, apply_reference

    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    try:
        for rows in ([0, 1, 2, 3], [3, 0]):
            logits = torch.randn(4, vocab, generator=gen).to(dtype)
            mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), words), dtype=torch.int32, generator=gen)
            expected = logits.clone()
            apply_reference(expected, MaskBatch(rows, mask))
            got = logits.to(device)
            index = None if rows == [0, 1, 2, 3] else torch.tensor(rows, device=device)
            apply_mask(got, mask.to(device), index)
            if not torch.equal(got.cpu(), expected):
                return f"differs from the reference ({len(rows)} rows)"
    except Exception as exc:  # noqa: BLE001 - reported; xgrammar's kernel is kept
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


class MaskedArgmaxGraphs:
    """A constrained step's tail, the masks on its scores then their argmax, replayed as one CUDA graph.

    Through the server at W-B json 100% the engine thread is what sets the pace, and queueing that tail took
    it 72-370 us a step for the mask kernel and 42-159 us for the argmax (behind a forward, H100 host;
    benchmarks/sample_issue.py, eleventh session), where one replay queues both. A graph reads fixed
    addresses, so it is keyed by the scores' (the logits of a decode step: the caching allocator hands the
    same block to the same shape step after step) and the device mask's (GrammarLink's mirror of one of its
    two buffers), and captured the `capture_after`-th time a key is seen; at most `limit` graphs, a key
    beyond them runs eagerly. The tokens a replay leaves are the graph's own tensor: the next replay of the
    same graph, two steps later (the mask buffers alternate), is queued after their last reader."""

    def __init__(self, capture_after: int = 2, limit: int = 64) -> None:
        self.capture_after, self.limit = capture_after, limit
        # key -> (graph, tokens, mask). Not the scores: holding their block would move the next step's logits.
        # A graph only replays while its key's address holds scores of its shape and dtype again.
        self.graphs: dict[tuple, tuple] = {}
        self._seen: dict[tuple, int] = {}
        self._pool = None
        self.replays = 0

    def argmax(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each row's argmax under its mask (row i of `mask` for row i of `scores`); scores are masked in place."""
        key = (scores.data_ptr(), tuple(scores.shape), scores.dtype, mask.data_ptr(), tuple(mask.shape))
        entry = self.graphs.get(key)
        if entry is not None:
            entry[0].replay()
            self.replays += 1
            return entry[1]
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if seen < self.capture_after or len(self.graphs) >= self.limit:
            return masked_argmax(scores, mask)
        return self._capture(key, scores, mask)

    def _capture(self, key: tuple, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run the tail eagerly (this step's tokens; it compiles what capture records), then capture it on a side
        stream, without torch.cuda.graph's synchronize and empty_cache (the scores' block must stay where it is)."""
        tokens = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
        masked_argmax(scores, mask, tokens)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(scores.device)
        stream.wait_stream(torch.cuda.current_stream(scores.device))
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                masked_argmax(scores, mask, tokens)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(scores.device).wait_stream(stream)
        self._pool = self._pool or graph.pool()
        self.graphs[key] = (graph, tokens, mask)
        return tokens


def masked_argmax(scores: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """apply_mask over every row in order, then the argmax: what MaskedArgmaxGraphs captures."""
    apply_mask(scores, mask)
    return torch.argmax(scores, dim=-1) if out is None else torch.argmax(scores, dim=-1, out=out)
