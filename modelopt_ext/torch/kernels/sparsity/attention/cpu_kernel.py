"""Compiled CPU backend of `paged_skip_softmax_attention` (docs/skip_softmax.md, version `semantics.CONTRACT_VERSION`).

The kernel is C++: one compiled file, `csrc/skip_softmax_cpu.cpp`, and the headers beside it (`csrc/*.h`, one per
instruction-set path), built with `torch.utils.cpp_extension.load` (g++ and ninja) the first time it is needed and
cached: a second process, or a second run of `make`, loads the cached library in well under a second. The build
directory is keyed on everything the binary depends on (the source and every header, torch version and ABI,
compiler flags, the CPU's instruction set, the contract's numbers), so two environments or machines sharing a cache
never load each other's builds, and an edit to any header builds anew. It is built with `-march=native` for the
machine it runs on. It reads caches in the query's dtype and FP8 caches (float8_e4m3fn, float8_e5m2, with the
layer's K and V scales). The contract's numbers (TILE_K, SPLIT_TOKENS, DECISION_BLOCK_ROWS, RECENT_WINDOW, the
version) are not written in the C++: they come from semantics.py as -D defines (`contract_defines`), and the built
library reports them back (`compiled_contract`).

Where it cannot build (no compiler, no ninja, a failing compile) `unavailable_reason()` says why and `auto` uses
the PyTorch reference; `MODELOPT_EXT_CPU_KERNEL=0` switches it off. The cache lives in `$MODELOPT_EXT_CACHE_DIR`,
else `$XDG_CACHE_HOME/modelopt_ext`, else `~/.cache/modelopt_ext` (subfolder `torch_extensions`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from . import semantics

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "skip_softmax_cpu.cpp"
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# -falign-loops=64: hot loops start on a cache line. Without it bf16 decode moved by 5-8 % with unrelated edits
# elsewhere in the source (code placement); with it, the same source decoded 1.02-1.09x faster (Xeon with AMX).
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-falign-loops=64")
_LDFLAGS = ("-fopenmp",)
# semantics.py's names of the numbers the C++ takes as -D defines (MODELOPT_EXT_<name>, csrc/common.h), in the order
# the op `contract` reports them.
CONTRACT_NAMES = ("CONTRACT_VERSION", "TILE_K", "SPLIT_TOKENS", "DECISION_BLOCK_ROWS", "RECENT_WINDOW")
DISABLE_ENV = "MODELOPT_EXT_CPU_KERNEL"
AMX_ENV = "MODELOPT_EXT_CPU_AMX"  # 0: bf16 stays off AMX tiles on CPUs with them
DOT_ENV = "MODELOPT_EXT_CPU_BF16_DOT"  # 0: bf16 prefill stays on the fp32 vector path where AMX tiles are not used
_OFF = ("0", "false", "no", "off")

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_root() -> Path:
    """Folder holding the built kernels (one subfolder per build key)."""
    base = os.environ.get("MODELOPT_EXT_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = os.path.join(xdg, "modelopt_ext")
    return Path(base) / "torch_extensions"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def headers() -> list[Path]:
    """The headers `SOURCE` includes (every `csrc/*.h`; shipped with the package, see pyproject.toml)."""
    return sorted(SOURCE.parent.glob("*.h"))


def contract_defines() -> tuple[str, ...]:
    """semantics.py's contract numbers as the -D defines the kernel is compiled with (its only source of them)."""
    return tuple(f"-DMODELOPT_EXT_{name}={int(getattr(semantics, name))}" for name in CONTRACT_NAMES)


def _cflags() -> tuple[str, ...]:
    return (*_CFLAGS, *contract_defines())


def build_key() -> str:
    """Hash of everything the compiled library depends on."""
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    for header in headers():  # name and text: an edit to any header, or a header added or removed, builds anew
        h.update(b"\0" + header.name.encode() + b"\0" + header.read_bytes())
    parts = (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version.split()[0], platform.machine(),
             " ".join(_cflags()), " ".join(_LDFLAGS), _cpu_signature())
    for part in parts:
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def torch_waits_on_lock_file(cpp_extension) -> bool:
    """Whether this torch guards extension builds with a file whose mere existence blocks (before torch 2.14)."""
    return not hasattr(cpp_extension, "FileLock")


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an OS lock on `build_dir` while building or loading into it.

    torch guards a build with a `lock` file and waits for it to vanish, forever: a build killed midway (Ctrl-C, an
    OOM kill, a lost machine) leaves it behind and every later start hangs without a word. The OS releases this
    lock when its holder dies, so a `lock` file found while holding it belongs to no running build: it is removed.
    torch 2.14 and later hold an OS lock themselves (their `lock` file may stay, harmlessly): nothing to do there.
    """
    from torch.utils import cpp_extension

    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file only
        fcntl = None
    if fcntl is None or not torch_waits_on_lock_file(cpp_extension):
        yield
        return
    with open(build_dir / ".build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that was stopped midway (it would block every build "
                               "after it)", stale)  # fmt: skip
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_extension(name: str, source: Path, build_dir: Path) -> None:
    """Build (or load the cached build of) the C++ file `source` as torch extension `name` in `build_dir`, with the
    kernel's flags and semantics.py's contract numbers (`contract_defines`); the headers it includes are found beside
    it (ninja rebuilds when one changes). Safe against concurrent builds and against builds that were killed midway."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=list(_cflags()),
            extra_ldflags=list(_LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


def _build():
    """Build (or load the cached build of) the extension; returns the op. Raises on failure."""
    name = f"modelopt_ext_skip_softmax_cpu_{build_key()}"
    build_dir = cache_root() / name
    cached = any(build_dir.glob(f"{name}*.so"))
    if not cached:
        logger.info("building the compiled CPU skip-softmax kernel (once, cached in %s)", build_dir)
    start = time.perf_counter()
    compile_extension(name, SOURCE, build_dir)
    if not cached:
        logger.info("built the CPU skip-softmax kernel in %.1f s", time.perf_counter() - start)
    ops = torch.ops.modelopt_ext_cpu
    if os.environ.get(AMX_ENV, "1").strip().lower() in _OFF:
        ops.amx_tiles(False)
    if os.environ.get(DOT_ENV, "1").strip().lower() in _OFF:
        ops.bf16_dot(False)
    return ops.skip_softmax_attention


def _load():
    op = _state.get("op")
    if op is not None:  # fast path once built: no lock per call
        return op, None
    with _lock:
        if "op" in _state or "reason" in _state:
            return _state.get("op"), _state.get("reason")
        if os.environ.get(DISABLE_ENV, "1").strip().lower() in _OFF:
            _state["reason"] = f"the compiled CPU kernel is switched off ({DISABLE_ENV}=0)"
        else:
            try:
                _state["op"] = _build()
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference, say why
                text = " ".join(str(exc).split())
                _state["reason"] = (
                    f"the compiled CPU kernel did not build ({type(exc).__name__}: {text[-600:]}); it needs g++ and "
                    f"ninja on PATH and a writable cache ({cache_root()})"
                )
        return _state.get("op"), _state.get("reason")


def unavailable_reason() -> str | None:
    """None when the compiled kernel is usable (building it on first call), else why not."""
    return _load()[1]


def available() -> bool:
    return unavailable_reason() is None


def amx_tiles(enable: bool | None = None) -> bool:
    """Whether bf16 calls run Q·K and P·V on AMX tiles (compiled for this CPU, granted by the OS, not switched off
    by `MODELOPT_EXT_CPU_AMX=0`); `enable` switches them on or off for this process first."""
    if _load()[0] is None:
        return False
    return bool(torch.ops.modelopt_ext_cpu.amx_tiles(enable))


def bf16_dot(enable: bool | None = None) -> bool:
    """Whether bf16 prefill can run Q·K and P·V on AVX512-BF16 dot products (VDPBF16PS) where AMX tiles are not
    used (compiled for this CPU, not switched off by `MODELOPT_EXT_CPU_BF16_DOT=0`); `enable` switches it on or off
    for this process first."""
    if _load()[0] is None:
        return False
    return bool(torch.ops.modelopt_ext_cpu.bf16_dot(enable))


def compiled_contract() -> dict[str, int] | None:
    """The contract numbers the loaded library was built with (`CONTRACT_NAMES` to values; semantics.py's own unless
    the build went wrong), or None when the compiled kernel is unavailable."""
    if _load()[0] is None:
        return None
    return dict(zip(CONTRACT_NAMES, (int(v) for v in torch.ops.modelopt_ext_cpu.contract()), strict=True))


def bf16_engine() -> str:
    """What bf16 prefill items run on here: "amx" (AMX tiles), "dot" (VDPBF16PS) or "vector" (fp32 FMAs); decode
    rows and head sizes the packed path does not take stay on the vector path (docs/design.md)."""
    if amx_tiles():
        return "amx"
    return "dot" if bf16_dot() else "vector"


def unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the compiled kernel does not cover this input (None when it does)."""
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        return f"the compiled CPU kernel runs on CPU tensors (got {q.device})"
    if q.dtype not in CPU_KERNEL_DTYPES:
        return f"the compiled CPU kernel covers {', '.join(str(d) for d in CPU_KERNEL_DTYPES)}, not {q.dtype}"
    if semantics.is_fp8_cache(k_cache) and k_cache.dim() != 4:
        return (f"the compiled CPU kernel reads {k_cache.dtype} caches as 4-D [num_blocks, page, Hkv, D] views (vLLM's "
                "`vec` layout); its 6-D `amx` layout is read for bf16 caches only")
    if k_cache.dim() == 6 and (q.dtype != torch.bfloat16 or tuple(k_cache.shape[i] for i in (2, 5)) != (16, 2)):
        return "the compiled CPU kernel reads 6-D cache views only as vLLM's bf16 amx layout (K [.., 16, Hkv, .., 2])"
    return unavailable_reason()


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def paged_skip_softmax_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    softmax_scale: float,
    log_sf: torch.Tensor | None,
    gamma: torch.Tensor,
    prompt_lens: torch.Tensor,
    calibrate: bool,
    out: torch.Tensor,
    counts: torch.Tensor | None = None,
    totals: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | None:
    """Compiled CPU backend (same arguments and result as the reference backend).

    q [total_q, Hq, D] and the [num_blocks, page, Hkv, D] cache views may have any strides; the cache is read in
    place, the 6-D views of vLLM's bf16 `amx` layout (`semantics.cache_geometry`) too. `log_sf` [B, T, 2] float32
    or None (dense, no counts), `gamma` [B, 2], `prompt_lens` [B]; with `calibrate` the output is dense and counts
    cover all T trials, else T == 1 and each row's drops are applied.
    `counts`: optional contiguous int64 [B, T, 2] buffer the kernel zeroes and fills (no allocation per call).
    `softcap` > 0: logit soft-capping (cap·tanh(s / cap)) before the skip test and the softmax.
    `sinks`: None or the attention sinks as a contiguous float32 [Hq] CPU tensor (`semantics.checked_sinks`).
    `totals`: optional (phase index [>= B] int64, totals [phases, 2] int64): trial 0's counts of sequence b are also
    added into totals[phase[b]] (serving statistics, inside the op). Returns counts [B, T, 2] int64 or None.
    FP8 caches (`semantics.FP8_CACHE_DTYPES`, 4-D views, q and out in fp32 / bf16 / fp16) are read in place: a slot's
    key and value are its bytes times `k_scale` and `v_scale` (finite, > 0; 1.0 for other caches).
    """
    op, reason = _load()
    if op is None:
        raise RuntimeError(f"backend='cpu' is unavailable: {reason}")
    return launch_cpu(
        q, k_cache, v_cache, _int32(block_table), _int32(cu_seqlens_q), _int32(seq_lens_k),
        softmax_scale=float(softmax_scale), log_sf=log_sf, gamma=gamma, prompt_lens=_int32(prompt_lens),
        calibrate=bool(calibrate), out=out, counts=counts, totals=totals, softcap=float(softcap), sinks=sinks, op=op,
        k_scale=float(k_scale), v_scale=float(v_scale),
    )  # fmt: skip


def launch_cpu(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, *, softmax_scale, log_sf, gamma,
               prompt_lens, calibrate, out, counts=None, totals=None, max_seqlen_k=None, workspace=None,
               decode_only=False, softcap=0.0, sinks=None, op=None, k_scale=1.0, v_scale=1.0):  # fmt: skip
    """The launch without conversions (the vLLM plugin's plan holds int32 contiguous tensors and float32 laws):
    one call of the compiled op. Same arguments as `paged_skip_softmax_attention_cpu`; `op` launches another build of
    the op with the same schema instead of this one (`bench_cpu.py --baseline-rev`: old and new then pay the same
    launch cost; without sinks the call passes no `sinks` argument, and with scales of 1.0 no scales, so builds
    older than sinks or FP8 caches take it too)."""
    op = op or _state.get("op") or _load()[0]
    if op is None:
        raise RuntimeError(f"backend='cpu' is unavailable: {unavailable_reason()}")
    phase_index, phase_totals = totals if totals is not None and log_sf is not None else (None, None)
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, softmax_scale, log_sf, gamma, prompt_lens,
            calibrate, out, counts if log_sf is not None else None, phase_index, phase_totals, softcap)  # fmt: skip
    scaled = k_scale != 1.0 or v_scale != 1.0
    if scaled:
        result = op(*args, sinks, k_scale, v_scale)
    else:
        result = op(*args) if sinks is None else op(*args, sinks)
    return result if log_sf is not None else None
