"""jax's persistent compilation cache, on by default: a second process loads its step functions
instead of compiling them again (minutes per compilation on TPU).

Where it lives, first match wins:

    a user's own jax_compilation_cache_dir        left alone (their choice)
    LLM(compilation_cache_dir=...)                 that folder; "" turns the cache off
    $JAXSERVE_COMPILATION_CACHE_DIR                the same, from the environment
    $XDG_CACHE_HOME/jaxserve/xla                   default (~/.cache/jaxserve/xla)

When jaxserve sets the folder it also caches every compilation, however quick (jax's default
skips those under a second, which on the CPU is most of them). ``CompileEvents`` counts
compilations and the ones loaded from the cache (jax's monitoring events), so the runner can
report fresh compilations and cache hits apart.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from dataclasses import dataclass

import jax

ENV_VAR = "JAXSERVE_COMPILATION_CACHE_DIR"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

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


class CompileEvents:
    """XLA compilations in this process, counted from jax's monitoring events: one
    ``/jax/core/compile/backend_compile_duration`` per compilation (fresh or loaded from the
    persistent cache) and one ``/jax/compilation_cache/cache_hits`` per cache load.

    jax reports each event in the thread that compiles, so the counts are kept per thread:
    a caller takes differences around its own call (``Counts.since``) and sees only the
    compilations that call caused, even while warm-up compiles in other threads. Nothing here
    depends on the traced function running Python side effects.
    """

    _lock = threading.Lock()
    _registered = False
    _local = threading.local()

    @dataclass(frozen=True)
    class Counts:
        compilations: int = 0  # fresh compilations and cache loads
        cache_hits: int = 0  # of which loaded from the persistent cache

        def since(self, before: CompileEvents.Counts) -> CompileEvents.Counts:
            return CompileEvents.Counts(
                self.compilations - before.compilations, self.cache_hits - before.cache_hits
            )

    @classmethod
    def in_thread(cls) -> CompileEvents.Counts:
        """The calling thread's counts so far."""
        cls._register()
        return getattr(cls._local, "counts", cls.Counts())

    @classmethod
    def _register(cls) -> None:
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_listener(cls._on_event)
                jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
                cls._registered = True

    @classmethod
    def _bump(cls, compilations: int, cache_hits: int) -> None:
        old = getattr(cls._local, "counts", cls.Counts())
        cls._local.counts = cls.Counts(old.compilations + compilations, old.cache_hits + cache_hits)

    @classmethod
    def _on_event(cls, event: str, **kwargs) -> None:
        if event == _HIT_EVENT:
            cls._bump(0, 1)

    @classmethod
    def _on_duration(cls, event: str, duration: float, **kwargs) -> None:
        if event == _COMPILE_EVENT:
            cls._bump(1, 0)
