"""Prefix caching keyed by the served law: a cached block is reused only by a request whose attention made the same
K/V.

A layer writes K/V computed from its input, and every layer after the first gets its input from the attention of
the layers before it; so a prompt's cached K/V depend on the law its request was served with (both phases: tokens
generated in decode become the prompt prefix of the next turn of a chat). vLLM keys a cached block by its tokens,
its parent block's hash and extra keys, among which the request's `cache_salt` (on the first block, so it reaches
every later block through the parent hash). Here each new request gets a salt that names its law:

- a request served with the checkpoint's law (no `sparse_attn_*` key, or keys that resolve to the same law) keeps
  its salt as it is: such requests share the cache with each other, as without the plugin;
- any other law (another target, dense, decode feedback) gets `SALT_MARK` + the law + "|" + the user's own salt, so
  it shares blocks only with requests served with the same law and the same user salt.

A user's salt that happens to start with `SALT_MARK` is rewritten too (`SALT_MARK` + "default|" + salt), so no
request can forge another law's key. The key is the law's values (c and γ per phase, and the feedback's target and
gain), resolved from the request's keys against the checkpoint (`request_targets.request_law_of`) exactly as the
workers resolve them, so two requests share blocks exactly when their rows are served the same. One engine serves one
checkpoint, and its prefix cache is its own, so the checkpoint needs no place in the key.

Where: vLLM hashes a request's blocks when it creates the `Request`, before its scheduler sees it, and offers no
hook there. The plugin's scheduler (vLLM's `scheduler_cls` option, which the plugin already sets: the aligned prefill
scheduler, or `KeyedScheduler` where alignment is switched off; vLLM logs that a scheduler's interface is not public)
sets the request's `cache_salt` in `add_request` and, when the salt changed, hashes
its blocks again with the request's own hasher (`Request.update_block_hashes`) before vLLM's scheduler looks them
up: one more pass over the prompt's tokens, only for requests not at the checkpoint's law (about 20 ms for 32k
tokens on 16-token pages, measured on a shared CPU core). Off where prefix caching and KV connectors are off
(calibration), where the plugin is off or the checkpoint has no block, and for a streaming session's later chunks
(the session keeps its first salt).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ...checkpoint.config_io import SparseAttentionConfigError, SparseAttentionSettings, settings_from_hf_config
from ...checkpoint.law import Law, PhaseLaw
from .env import sparse_attention_enabled
from .law_rows import RequestLaw
from .request_targets import RequestTargetError, request_law_of

logger = logging.getLogger(__name__)

SALT_MARK = "modelopt-sparse-attn:"
"""Every salt the plugin makes starts with this."""

_DEFAULT = "default"
_KEYED_MODULES = (__name__, __name__.rpartition(".")[0] + ".aligned_scheduler")  # scheduler classes that key


def _phase_key(name: str, law: PhaseLaw) -> str:
    return f"{name}=dense" if law.is_dense else f"{name}=c{law.c!r},g{law.gamma!r}"  # repr: exact for floats


def law_key(request_law: RequestLaw) -> str:
    """The key of a served law: its values, exactly (no "|" in it, never "default")."""
    law, feedback = request_law.law, request_law.feedback
    parts = [_phase_key("prefill", law.prefill), _phase_key("decode", law.decode)]
    if feedback is not None:
        parts.append(f"feedback=t{feedback.target!r},b{feedback.gain!r}")
    return ";".join(parts)


def salted(user_salt: str | None, key: str | None) -> str | None:
    """The cache salt of a request with the user's `user_salt` and the law's `key` (None: the checkpoint's law).

    One-to-one: different (user salt, key) pairs never give the same salt (vLLM treats "" as no salt)."""
    if key is None:
        if user_salt and user_salt.startswith(SALT_MARK):
            return f"{SALT_MARK}{_DEFAULT}|{user_salt}"
        return user_salt
    return f"{SALT_MARK}{key}|{user_salt or ''}"


class PrefixKeys:
    """One engine's prefix-cache keys: the law of each request, against the checkpoint's `settings`."""

    def __init__(self, settings: SparseAttentionSettings) -> None:
        self.settings = settings
        self.default = RequestLaw(Law.of(settings))

    def key(self, extra_args: Mapping[str, Any] | None) -> str | None:
        """The key of a request's law; None for the checkpoint's law. Keys the workers refuse give None too: the
        worker serves such a request at the checkpoint's targets (admission refuses them first where it can)."""
        try:
            request_law = request_law_of(extra_args, self.settings)
        except RequestTargetError:
            return None
        if request_law is None or request_law == self.default:
            return None
        return law_key(request_law)

    def apply(self, request) -> bool:
        """Give a new vLLM `Request` the salt of its law, and hash its blocks again if the salt changed. Returns
        whether it changed."""
        params = getattr(request, "sampling_params", None)
        salt = salted(request.cache_salt, self.key(getattr(params, "extra_args", None)))
        if salt == request.cache_salt:
            return False
        request.cache_salt = salt
        del request.block_hashes[:]  # hashed at creation with the old salt; the hasher restarts from block 0
        request.update_block_hashes()
        return True


def rekeying_problem() -> str | None:
    """Why this vLLM's requests cannot be given a salt after creation, or None."""
    from vllm.v1.request import Request

    if "cache_salt" not in inspect.signature(Request.__init__).parameters:
        return "this vLLM's Request takes no cache_salt"
    if not callable(getattr(Request, "update_block_hashes", None)):
        return "this vLLM's Request cannot hash its blocks again (no update_block_hashes)"
    return None


def _caches_blocks(vllm_config) -> bool:
    """Whether the engine keeps K/V by block hash: vLLM's prefix cache, or a KV connector (which sees the salt)."""
    cache = getattr(vllm_config, "cache_config", None)
    return bool(getattr(cache, "enable_prefix_caching", False)) or getattr(vllm_config, "kv_transfer_config",
                                                                             None) is not None  # fmt: skip


def engine_prefix_keys(vllm_config) -> PrefixKeys | None:
    """The keys of an engine (None: nothing to key: no block cache, the plugin off, or no checkpoint block)."""
    if not _caches_blocks(vllm_config) or not sparse_attention_enabled():
        return None
    model_config = getattr(vllm_config, "model_config", None)
    try:
        settings = settings_from_hf_config(getattr(model_config, "hf_config", None))
    except SparseAttentionConfigError:  # refused when the engine config was made; not this module's to say
        return None
    if settings is None:
        return None
    problem = rekeying_problem()
    if problem is not None:
        logger.warning("prefix cache not keyed by target (%s): requests at different sparsity targets may reuse "
                       "each other's cached blocks; serve with --no-enable-prefix-caching where that matters",
                       problem)  # fmt: skip
        return None
    return PrefixKeys(settings)


class PrefixKeyMixin:
    """Put in front of a vLLM `Scheduler` (sub)class: each new request's cache salt names its law (above)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._modelopt_prefix_keys = engine_prefix_keys(getattr(self, "vllm_config", None))
        if self._modelopt_prefix_keys is not None:
            logger.info("prefix cache keyed by target: a request served with another law than the checkpoint's "
                        "(its own targets, dense, decode feedback) reuses only blocks of that law")  # fmt: skip

    def add_request(self, request) -> None:
        keys = self._modelopt_prefix_keys
        if keys is not None and request.request_id not in self.requests:  # not a streaming session's next chunk
            keys.apply(request)
        super().add_request(request)


class KeyedScheduler(PrefixKeyMixin, Scheduler):
    """vLLM's `Scheduler` with the prefix cache keyed by target (engines whose prefill chunks are not aligned)."""


class KeyedAsyncScheduler(PrefixKeyMixin, AsyncScheduler):
    """vLLM's `AsyncScheduler` with the prefix cache keyed by target."""


def _keys_prefixes(scheduler_cls) -> bool:
    if isinstance(scheduler_cls, str):
        return scheduler_cls.rpartition(".")[0] in _KEYED_MODULES
    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, PrefixKeyMixin)


def install_prefix_keys(vllm_config, settings: SparseAttentionSettings | None) -> str:
    """Key the prefix cache of the engine of `vllm_config` by target (call it after the aligned scheduler's
    install, which keys it already, before vLLM starts the engine core). Returns what it did, in words."""
    if settings is None or not _caches_blocks(vllm_config):
        return "off"
    scheduler = vllm_config.scheduler_config
    current = scheduler.scheduler_cls
    if _keys_prefixes(current):
        return "scheduler"
    if current is None:
        cls = KeyedAsyncScheduler if getattr(scheduler, "async_scheduling", False) else KeyedScheduler
        scheduler.scheduler_cls = f"{cls.__module__}.{cls.__qualname__}"
        return "scheduler"
    logger.warning("prefix cache not keyed by target: scheduler_cls %r is served without the plugin's scheduler, "
                   "so requests at different sparsity targets may reuse each other's cached blocks; serve with "
                   "--no-enable-prefix-caching, or give them different cache_salt values, where that matters",
                   current)  # fmt: skip
    return "off"


__all__ = [
    "SALT_MARK",
    "KeyedAsyncScheduler",
    "KeyedScheduler",
    "PrefixKeyMixin",
    "PrefixKeys",
    "engine_prefix_keys",
    "install_prefix_keys",
    "law_key",
    "rekeying_problem",
    "salted",
]
