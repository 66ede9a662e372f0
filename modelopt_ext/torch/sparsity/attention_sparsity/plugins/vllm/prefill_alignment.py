"""The alignment rules of prefill chunks and prefix-cache hits, as pure arithmetic on positions (no vLLM).

Contract versions 4 and 5 (docs/skip_softmax.md) decide prompt rows per aligned block of `DECISION_BLOCK_ROWS` (64)
absolute positions: a block drops a tile only when every one of its prompt rows *in the same kernel call* drops it.
A row's output stays independent of how vLLM chunks a prompt only if every block of prompt positions is computed in
one attention call, so in every engine step the first new position of a request's prefill chunk must be a multiple
of 64 or at least the prompt length:

(a) a prefill chunk that ends before the prompt's end ends at a multiple of 64 (rounded down);
(b) a prefix-cache hit is cut back to a multiple of 64 tokens.

Decode steps, chunks that reach the prompt's end, and positions past the prompt (decode rows, also when a
preempted request recomputes them) are free. A preempted request recomputes from 0 or from an aligned hit.

These rules live apart from the scheduler that applies them (plugins/vllm/aligned_scheduler.py) so that they read,
and are tested, as arithmetic alone.
"""

from __future__ import annotations

from modelopt_ext.torch.kernels.sparsity.attention.semantics import DECISION_BLOCK_ROWS

ALIGN = DECISION_BLOCK_ROWS
"""Prefill chunks start at multiples of this many absolute positions (or at/after the prompt's end)."""

_MAX_HIT_TRIES = 4  # aligned targets tried per lookup before a hit is given up (each: at most two lookups)


def aligned_chunk_length(start: int, num_new_tokens: int, prompt_len: int, max_prefill_tokens: int, *,
                         may_wait: bool = True) -> int:  # fmt: skip
    """The length of a chunk of `num_new_tokens` positions from `start` once its end is cut back to a multiple of
    `ALIGN`: unchanged when it reaches the prompt's end (or starts past it). A chunk that cannot reach the next
    multiple becomes 0 (the request waits a step for budget) when a chunk of `max_prefill_tokens` could reach it;
    otherwise, or when `may_wait` is False (a multimodal request whose encoder budget cut the chunk, which waiting
    would not change), it keeps its length: progress before alignment."""
    end = start + num_new_tokens
    if num_new_tokens <= 0 or start >= prompt_len or end >= prompt_len:
        return num_new_tokens
    aligned_end = end // ALIGN * ALIGN
    if aligned_end > start:
        return aligned_end - start
    next_boundary = (start // ALIGN + 1) * ALIGN
    if may_wait and next_boundary - start <= max_prefill_tokens:
        return 0
    return num_new_tokens


def is_aligned_chunk(start: int, num_new_tokens: int, prompt_len: int) -> bool:
    """Whether a chunk of `num_new_tokens` positions from `start` keeps every block of prompt positions in one call:
    it starts at a multiple of `ALIGN` and ends at one or at/after the prompt's end, or holds no prompt position."""
    if start >= prompt_len or num_new_tokens <= 0:
        return True
    end = start + num_new_tokens
    return start % ALIGN == 0 and (end >= prompt_len or end % ALIGN == 0)


def aligned_hit(find, block_hashes, max_cache_hit_length: int, *, slack: int):
    """A prefix-cache lookup (`find(block_hashes, max_cache_hit_length)`, vLLM's coordinator method, whose result's
    second item is the hit length) whose hit is a multiple of `ALIGN`. An unaligned hit H is looked up again with
    the cap rounded down (A = H // ALIGN * ALIGN), and with A + `slack` (one block: a lookup may drop its last
    block, as EAGLE's does); a result of exactly A is taken. Up to `_MAX_HIT_TRIES` multiples down, then no hit."""
    result = find(block_hashes, max_cache_hit_length)
    hit = result[1]
    if hit % ALIGN == 0:
        return result
    target = hit // ALIGN * ALIGN
    for _ in range(_MAX_HIT_TRIES):
        if target <= 0:
            break
        for cap in (target, target + slack):
            if cap > max_cache_hit_length:
                break
            candidate = find(block_hashes, cap)
            if candidate[1] == target:
                return candidate
        target -= ALIGN
    return find(block_hashes, 0)


__all__ = ["ALIGN", "aligned_chunk_length", "aligned_hit", "is_aligned_chunk"]
