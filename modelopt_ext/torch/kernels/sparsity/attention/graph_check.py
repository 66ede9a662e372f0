"""Can this machine replay a captured sparse decode launch? The self-test behind full CUDA graphs (issue #26).

A full decode graph freezes everything the host decided when it was captured: the grid, the scalar arguments, the
buffers' addresses. At replay only the buffers' contents change (this step's lengths, block tables, λ). The
sparse launch is built for that (`launch_triton`: grids from the batch size and `max_model_len` only, counts and
split-K workspace in persistent buffers, no host branch on lengths), but whether the whole chain holds on a given
GPU, driver, Triton and PyTorch is a fact only that machine can tell. So the vLLM plugin runs
`decode_graph_self_test` at engine start, at the engine's own shapes, before it declares full-graph support.

What it does, per batch size: persistent buffers at the captured batch size; one warm-up launch, then the capture
of one launch (`capture`); then a few rounds that rewrite lengths (including padding rows with no new token and no
keys, as vLLM pads a batch to its captured size), block tables (shuffled pages) and λ (dense rows and rows that
drop tiles) in place, poison the output, replay, and compare the output rows and the counts with an eager launch on
the same inputs (its grid sized from this round's lengths). Padding rows must stay untouched and count nothing.
With `sinks=True` (a model with attention sinks, gpt-oss) every launch also takes a persistent [Hq] sinks buffer,
rewritten each round like the rest, so the replay must read the sinks from memory, not from the capture. With an FP8
`cache_dtype` (an engine serving `--kv-cache-dtype fp8*`) the caches hold FP8 bytes read with scales != 1, as the
engine's graphs launch them.

`capture(fn) -> replay` is `cuda_graph_capture` on a GPU. Anywhere else the test runs with `replay_by_call`, which
"replays" by calling the same closure again: the host values it froze at capture (batch size, `max_model_len`,
buffers) are reused while the buffers' contents change, which is everything a graph does but the capture itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .semantics import RECENT_WINDOW, SPLIT_TOKENS, TILE_K, decode_workspace_numel

Launch = Callable[..., torch.Tensor | None]


def cuda_graph_capture(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture `fn` (one warm-up on a side stream first, as PyTorch asks) in a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:  # holds the graph (and its memory pool) as long as the replay lives
        graph.replay()

    return replay


def replay_by_call(fn: Callable[[], object]) -> Callable[[], None]:
    """Stand-in for a capture where there is no CUDA: the replay calls the same closure (same host values)."""
    fn()
    return lambda: fn()


class _DecodeBuffers:
    """Persistent inputs of one captured decode launch, rewritten in place between replays."""

    K_SCALE, V_SCALE = 0.5, 2.0  # an FP8 cache's scales: != 1, so a launch that ignored them would differ

    def __init__(self, batch, *, num_heads, num_kv_heads, head_size, page_size, max_model_len, dtype, device, gen,
                 sinks=False, cache_dtype=None):
        self.batch, self.page, self.max_model_len = batch, page_size, max_model_len
        self.gen, self.dtype, self.device = gen, dtype, device
        self.cache_dtype = cache_dtype or dtype
        self.scales = {} if cache_dtype in (None, dtype) else {"k_scale": self.K_SCALE, "v_scale": self.V_SCALE}
        self.width = math.ceil(max_model_len / page_size)
        self.longest = min(max_model_len, 2 * SPLIT_TOKENS + 300)  # three splits: the merge path runs
        self.num_blocks = batch * math.ceil(self.longest / page_size) + 1  # + the null block vLLM pads with
        shape = (self.num_blocks, page_size, num_kv_heads, head_size)
        self.k = self._cached(self._randn(shape), "k_scale")
        self.v = self._cached(self._randn(shape), "v_scale")
        self.q = self._randn((batch, num_heads, head_size))
        # A direction every query leans towards and each sequence's first key holds strongly: the anchor tile then
        # stands out as in real attention, so whole GQA groups drop tiles (version 4 decides per group).
        self.anchor = torch.nn.functional.normalize(self._randn((head_size,)).float(), dim=0).to(device, dtype)
        self.out = torch.empty(batch, num_heads, head_size, dtype=dtype, device=device)
        self.block_table = torch.zeros(batch, self.width, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.cu_q = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        self.prompt_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.log_sf = torch.zeros(batch, 1, 2, dtype=torch.float32, device=device)
        self.gamma = torch.ones(batch, 2, dtype=torch.float32, device=device)
        self.counts = torch.zeros(batch, 1, 2, dtype=torch.int64, device=device)
        self.sinks = torch.zeros(num_heads, dtype=torch.float32, device=device) if sinks else None
        self.live = batch

    def _randn(self, shape):
        return torch.randn(shape, generator=self.gen, dtype=torch.float32).to(self.device, self.dtype)

    def _cached(self, x, scale: str):
        """Values as the cache holds them: the model's dtype, or FP8 bytes of x / scale."""
        return x if not self.scales else (x.float() / self.scales[scale]).to(self.cache_dtype)

    def _ints(self, low, high, n):
        return torch.randint(low, high, (n,), generator=self.gen).tolist()

    def rewrite(self, round_index: int) -> None:
        """New lengths, pages, λ and queries for one round, written into the same buffers."""
        b = self.batch
        self.live = b - 1 if b > 1 else 1  # the last row pads the batch (no new token, no keys) when B > 1
        lens = self._ints(1, self.longest + 1, b)
        # A row drops tiles only past its recent window (contract versions 4-5): the row that decides in every round
        # (row 0 in short rounds, row 1 in long ones, where row 0 runs dense) reaches past it.
        reach = min(self.longest, 3 * TILE_K + RECENT_WINDOW)
        lens[0] = self.longest if round_index % 2 else max(reach, self.longest // 7)  # long and short rounds
        if round_index % 2 and self.live > 1:
            lens[1] = max(lens[1], reach)
        lens[self.live:] = [0] * (b - self.live)
        pages = torch.randperm(self.num_blocks - 1, generator=self.gen) + 1  # block 0 is the null block
        table = torch.zeros(b, self.width, dtype=torch.int32)
        used = 0
        for row, n in enumerate(lens):
            need = math.ceil(n / self.page)
            table[row, :need] = pages[used:used + need].to(torch.int32)
            used += need
        self.block_table.copy_(table)
        for row, n in enumerate(lens):
            if n:
                self.k[int(table[row, 0]), 0] = self._cached(8.0 * self.anchor, "k_scale")
            if n > 2 * RECENT_WINDOW and round_index % 3 == 1:
                # A stronger key inside the row's recent window: its max, not the anchor, is the row's reference
                # (contract version 5), so decisions depend on where the window lies in this round's pages.
                pos = n - 1 - int(self._ints(0, RECENT_WINDOW // 2, 1)[0])
                self.k[int(table[row, pos // self.page]), pos % self.page] = self._cached(10.0 * self.anchor, "k_scale")
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q_lens = [1] * self.live + [0] * (b - self.live)
        self.cu_q.copy_(torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32))
        self.prompt_lens.copy_(torch.tensor([max(0, n - 1 - 40) for n in lens], dtype=torch.int32))
        # λ: 0.3 .. 0.95 at the row's length (drops tiles), every other round one row dense (-inf)
        lam = torch.rand(b, generator=self.gen) * 0.65 + 0.3
        c = (lam.log() + torch.tensor([math.log(max(n, 1)) for n in lens])).to(torch.float32)
        log_sf = torch.stack([c, c], dim=1)
        if round_index % 2 and self.live > 1:
            log_sf[0] = -math.inf
        self.log_sf.copy_(log_sf[:, None, :])
        self.q.copy_(self._randn(tuple(self.q.shape)) + 4.0 * self.anchor)
        if self.sinks is not None:  # around the scores' maxima: they change outputs and decisions
            n = self.sinks.shape[0]
            self.sinks.copy_(torch.rand(n, generator=self.gen, dtype=torch.float32) * 4.0 - 1.0)

    def args(self):
        return (self.q, self.k, self.v, self.block_table, self.cu_q, self.seq_lens)


def _compare(name, got_out, got_counts, want_out, want_counts, live, atol) -> str | None:
    if not torch.isnan(got_out[live:]).all():
        return f"{name}: the replay wrote padding rows"
    if not torch.isfinite(got_out[:live]).all():
        return f"{name}: the replay left real rows unwritten or non-finite"
    err = (got_out[:live].float() - want_out[:live].float()).abs().max().item()
    if err > atol:
        return f"{name}: replayed output differs from the eager launch by {err:.3g} (tolerance {atol})"
    if not torch.equal(got_counts, want_counts):
        return f"{name}: replayed counts {got_counts.flatten().tolist()} != eager {want_counts.flatten().tolist()}"
    if live < got_counts.shape[0] and got_counts[live:].any():
        return f"{name}: padding rows counted tiles"
    if not got_counts[:live, 0, 1].any():
        return f"{name}: no tile was dropped; the test did not exercise skipping"
    return None


def decode_graph_self_test(
    launch: Launch,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    page_size: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batch_sizes: Sequence[int] = (1, 4),
    rounds: int = 3,
    capture: Callable[[Callable[[], object]], Callable[[], None]] | None = None,
    seed: int = 0,
    sinks: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> str | None:
    """None when a captured sparse decode launch replays exactly like eager launches; else what went wrong.

    `launch` is a kernel launcher (`api.kernel_launcher(backend)`); `capture` defaults to `cuda_graph_capture` on
    a CUDA device and `replay_by_call` elsewhere. `sinks`: launch with attention sinks (one float32 logit per query
    head, as a gpt-oss model's decode graphs do); False tests the sinkless launch. `cache_dtype`: the caches' dtype
    when it is not `dtype` (an FP8 cache, read with scales). Exceptions are reported, not
    raised: a failure means "declare no full-graph support", never "do not start".
    """
    device = torch.device(device)
    if capture is None:
        capture = cuda_graph_capture if device.type == "cuda" else replay_by_call
    gen = torch.Generator().manual_seed(seed)
    try:
        for batch in batch_sizes:
            buf = _DecodeBuffers(batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                                 page_size=page_size, max_model_len=max_model_len, dtype=dtype, device=device,
                                 gen=gen, sinks=sinks, cache_dtype=cache_dtype)  # fmt: skip
            problem = _replay_rounds(launch, buf, capture, rounds)
            if problem is not None:
                return problem
    except Exception as exc:  # noqa: BLE001 - any failure means: no full graphs, with the reason
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return None


def _replay_rounds(launch: Launch, buf: _DecodeBuffers, capture, rounds: int) -> str | None:
    """Capture one launch on `buf`, then replay it for `rounds` rewritten rounds against eager launches."""
    num_heads, head_size = buf.q.shape[1], buf.q.shape[2]
    scale = head_size**-0.5
    atol = 1e-5 if buf.dtype == torch.float32 else 2e-2
    workspace = tuple(
        torch.empty(n, dtype=torch.float32, device=buf.device)
        for n in decode_workspace_numel(buf.batch, num_heads, head_size, buf.max_model_len)
    )

    # sinks only when the model has them: a sinkless launch keeps the signature every backend always took
    with_sinks = {} if buf.sinks is None else {"sinks": buf.sinks}
    with_sinks.update(buf.scales)  # an FP8 cache's scales (none otherwise, so older launchers still take the call)

    def captured():
        launch(*buf.args(), softmax_scale=scale, log_sf=buf.log_sf, gamma=buf.gamma, prompt_lens=buf.prompt_lens,
               calibrate=False, out=buf.out, max_seqlen_k=buf.max_model_len, counts=buf.counts,
               workspace=workspace, decode_only=True, **with_sinks)  # fmt: skip

    buf.rewrite(0)
    replay = capture(captured)
    for r in range(1, rounds + 1):
        buf.rewrite(r)
        buf.out.fill_(math.nan)
        replay()
        if buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)
        got_out, got_counts = buf.out.clone(), buf.counts.clone()
        buf.out.fill_(math.nan)
        want_counts = launch(*buf.args(), softmax_scale=scale, log_sf=buf.log_sf, gamma=buf.gamma,
                             prompt_lens=buf.prompt_lens, calibrate=False, out=buf.out,
                             max_seqlen_k=int(buf.seq_lens.max().item()), **with_sinks)  # fmt: skip
        problem = _compare(f"batch {buf.batch}, round {r}", got_out, got_counts, buf.out, want_counts, buf.live,
                           atol)  # fmt: skip
        if problem is not None:
            return problem
    return None
