"""jax's persistent compilation cache, on by default: a second process loads its step functions
instead of compiling them again (minutes per compilation on TPU).

Where it lives, first match wins:

    a user's own jax_compilation_cache_dir        left alone (their choice)
    LLM(compilation_cache_dir=...)                 that folder; "" turns the cache off
    $JAXSERVE_COMPILATION_CACHE_DIR                the same, from the environment
    $XDG_CACHE_HOME/jaxserve/xla                   default (~/.cache/jaxserve/xla)

When jaxserve sets the folder it also caches every compilation, however quick (jax's default
skips those under a second, which on the CPU is most of them). ``CacheHits`` counts the
compilations that were loaded from the cache (jax's monitoring event), so the runner can report
fresh compilations and cache hits apart.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading

import jax

ENV_VAR = "JAXSERVE_COMPILATION_CACHE_DIR"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"

logger = logging.getLogger("jaxserve")


def default_cache_dir() -> pathlib.Path:
    """$XDG_CACHE_HOME/jaxserve/xla, or ~/.cache/jaxserve/xla."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxserve" / "xla"


def enable_compilation_cache(setting: str | None = None) -> str | None:
    """Point jax's persistent compilation cache at jaxserve's folder (see the module docstring)
    unless the user configured jax's own; call before the engine compiles anything.

    Args:
        setting: LLM(compilation_cache_dir=...): None for the environment or the default, "" for
            off, else the folder.

    Returns:
        The folder in use (the user's own included), or None when the cache is off.
    """
    own = jax.config.jax_compilation_cache_dir
    if own:
        return own
    if setting is None:
        setting = os.environ.get(ENV_VAR)
    if setting == "":
        return None
    folder = pathlib.Path(setting) if setting is not None else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("compilation cache off: cannot create %s (%s)", folder, e.strerror)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return str(folder)


class CacheHits:
    """Compilations loaded from the persistent cache in this process, by any function (jax
    reports them as events, not per function: callers take differences around their calls)."""

    _lock = threading.Lock()
    _count = 0
    _registered = False
    _local = threading.local()  # the same count, of this thread's compilations only

    @classmethod
    def count(cls) -> int:
        cls._register()
        return cls._count

    @classmethod
    def count_in_thread(cls) -> int:
        """Cache hits of compilations run by the calling thread (jax reports each in the thread
        that compiles): what concurrent compilations tell apart with."""
        cls._register()
        return getattr(cls._local, "count", 0)

    @classmethod
    def _register(cls) -> None:
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_listener(cls._on_event)
                cls._registered = True

    @classmethod
    def _on_event(cls, event: str, **kwargs) -> None:
        if event == _HIT_EVENT:
            with cls._lock:
                cls._count += 1
            cls._local.count = getattr(cls._local, "count", 0) + 1
