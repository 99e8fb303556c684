"""GrammarCompiler: compiles structured-output constraints in a thread pool, cached by
(kind, spec).

Compiling happens when a request is checked (LLMEngine.check_request), in the caller's thread:
the server and AsyncLLM check requests off the engine thread, so a request whose grammar is
still compiling waits there while every other request keeps stepping. A constraint asked for
again (the same schema in every request of a batch, an n > 1 request) is compiled once; a
failure is cached too, so a bad schema sent again is refused at once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from jaxserve.sampling_constraints import StructuredOutputsParams
from jaxserve.structured.backend import CompiledGrammar, StructuredOutputBackend

logger = logging.getLogger("jaxserve")

DEFAULT_CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)


class GrammarCompiler:
    """Compiles and caches constraints for one backend.

    Args:
        backend: the grammar library (backend.py).
        max_workers: compile threads (llguidance drops the GIL while it compiles).
        cache_size: constraints kept, most recently used first.
    """

    def __init__(
        self,
        backend: StructuredOutputBackend,
        max_workers: int = 2,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 1 or max_workers < 1:
            raise ValueError(
                f"GrammarCompiler: cache_size and max_workers must be >= 1, got {cache_size}, "
                f"{max_workers}"
            )
        self.backend = backend
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="jaxserve-grammar")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # backend compilations started (cache misses)

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compilation of ``params``: a cached one, or a new one in the pool."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self.backend.compile, *key)
            self.num_compiled += 1
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Wait for ``params``' compilation (compiled in the pool, or cached).

        Raises:
            ValueError: naming the field (``structured_outputs.json`` ...) and the library's
                reason, for a constraint the backend cannot compile.
        """
        try:
            return self.submit(params).result()
        except ValueError as e:
            raise ValueError(f"SamplingParams.structured_outputs.{params.kind}: {e}") from None
        except Exception as e:  # the library failed otherwise: still this request's fault
            logger.warning("structured outputs: %s failed to compile: %r", params.kind, e)
            raise ValueError(
                f"SamplingParams.structured_outputs.{params.kind}: does not compile ({e})"
            ) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
