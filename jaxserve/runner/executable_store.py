"""Serialized step executables: a second process loads each compiled step and block copy
directly, without tracing, lowering or compiling it again. (jax's persistent compilation cache,
compile_cache.py, skips only the compiling: its key is a hash of the lowered program, so every
load still traces and lowers, ~0.4 s a step for the demo model.)

A store is a folder (the format ``jaxserve compile --output`` can share)::

    manifest.json     {"format": 1, "fields": {name: value}}: what every executable depends on
    <entry>.bin       pickle of (serialized executable, in_tree, out_tree), one per executable

An engine's store is ``<compilation cache>/executables/<hash of its fields>/``. The fields
(``engine_fields``) are everything an executable depends on besides the shapes of its
arguments: jax, jaxlib, the backend and its devices, XLA_FLAGS, jaxserve's own source (a hash of
its .py files: an edited step function never loads a stale executable), the model's
architecture, the plan, and the engine settings. An entry is named by the function and a hash of
its argument signature (step_compiles.signature: every leaf's dtype and shape), so an executable
is only ever called with the arguments it was compiled for; jax also checks them at each call.
Anything that does not match or fails to load is compiled instead (and logged), then saved.

On the CPU only executables XLA compiled in this process are saved, never one jax loaded
from its persistent compilation cache: XLA:CPU (jaxlib 0.10.2) builds a loaded executable from
the serialized proto's object files without keeping them, so serializing it again writes its
thunks and kernel names but no object code, and a process that loads that fails at the first
call ("Function <kernel> not found": no object file was linked). A fresh compile keeps its
object files and serializes whole, before or after it ran. So a compile whose executable the
store will save bypasses jax's cache (``fresh_compiles``), and the store refuses a cache hit
that still comes its way (``save(from_cache=True)``). (XLA:GPU exports a loaded executable's
kept binary, so elsewhere a cache hit is saved.)

Loading runs only what the store holds: serialized executables are code, so a store must come
from this machine's own cache folder or from a source as trusted as the code itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import pickle
import threading
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

logger = logging.getLogger("jaxserve")

FORMAT = 1
MANIFEST = "manifest.json"
_SOURCE_ROOT = pathlib.Path(__file__).resolve().parents[1]  # the jaxserve package
_source_lock = threading.Lock()
_source_hash: str | None = None


def source_fingerprint() -> str:
    """A hash of every .py, .cc and .h file of the jaxserve package (its linked subpackages
    included: the C++ kernels that executables call by name too),
    computed once per process."""
    global _source_hash
    with _source_lock:
        if _source_hash is None:
            digest = hashlib.sha256()
            for folder, dirs, files in sorted(os.walk(_SOURCE_ROOT, followlinks=True)):
                dirs.sort()
                for name in sorted(f for f in files if f.endswith((".py", ".cc", ".h"))):
                    path = pathlib.Path(folder, name)
                    digest.update(str(path.relative_to(_SOURCE_ROOT)).encode())
                    digest.update(path.read_bytes())
            _source_hash = digest.hexdigest()[:16]
        return _source_hash


def engine_fields(
    devices: list[Any], arch: Any, plan: dict[str, Any], engine: dict[str, Any]
) -> dict[str, str]:
    """The fields a store is keyed by (module docstring).

    Args:
        devices: the engine's devices (its mesh's, in order).
        arch: the model's architecture (a dataclass; a draft model's goes in ``engine``).
        plan: ExecutionPlan.as_dict().
        engine: the engine settings the step depends on (sizes, dtypes, speculation).
    """
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        # A compile-only device (jaxserve compile --output) has the platform and kind of the
        # chip it stands for; its client's version is not the chip's, so it is left out.
        "backend": devices[0].platform,
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jaxserve_source": source_fingerprint(),
        "model": _canonical(dataclasses.asdict(arch)),
        "plan": _canonical(plan),
        "engine": _canonical(engine),
    }


def fields_of(resolved: Any, arch: Any) -> dict[str, str]:
    """The fields of an engine (factory.ResolvedModel ``resolved``, its model's ``arch``): the
    engine settings its step and block copy depend on."""
    config = resolved.config
    engine = dict(
        dtype=resolved.plan.dtype,
        quantization=config.model.quantization,
        max_model_len=config.model.max_model_len,
        block_size=config.cache.block_size,
        num_kv_blocks=config.cache.num_kv_blocks,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        speculative=config.speculative,
        draft_arch=resolved.draft_arch,
    )
    devices = list(resolved.sharding.mesh.devices.flat)
    return engine_fields(devices, arch, resolved.plan.as_dict(), engine)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _digest(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()[:16]


class ExecutableStore:
    """One folder of serialized executables whose manifest holds ``fields``.

    Thread-safe: warm-up loads and saves from its compile threads; each file is written
    whole (a temporary file renamed), so a reader never sees half of one.
    """

    def __init__(
        self, folder: pathlib.Path, fields: dict[str, str], read_only: bool = False
    ) -> None:
        self.folder = folder
        self.fields = fields
        self.read_only = read_only  # a precompiled folder: what compiles is not saved there
        self.devices: list[Any] | None = None  # the engine's devices, in mesh order: None: all
        self.num_loaded = 0
        self.num_saved = 0
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, cache_dir: str, fields: dict[str, str]) -> ExecutableStore | None:
        """The store of an engine with ``fields`` under ``cache_dir`` (created when missing;
        when none matches, the closest one's differing fields are logged). None when the
        folder cannot be made (logged): then everything compiles as before."""
        root = pathlib.Path(cache_dir) / "executables"
        folder = root / _digest(fields)
        store = cls(folder, fields)
        if (folder / MANIFEST).exists():
            return store if store.check() else None
        _log_closest(root, fields)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _write_whole(folder / MANIFEST, _canonical({"format": FORMAT, "fields": fields}))
        except OSError as e:
            logger.warning("executable store off: cannot write %s (%s)", folder, e.strerror)
            return None
        return store

    @classmethod
    def precompiled(cls, folder: str, fields: dict[str, str]) -> ExecutableStore:
        """The executables of ``jaxserve compile --output`` (LLM(precompiled=...)), read only.

        Raises:
            FileNotFoundError: no manifest in ``folder``.
            ValueError: a manifest of another format or other fields (the first that differs
                is named, with both values).
        """
        path = pathlib.Path(folder) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"precompiled={folder!r}: no {MANIFEST} there")
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"precompiled={folder!r}: format {manifest.get('format')!r}, this "
                             f"jaxserve reads {FORMAT}")  # fmt: skip
        theirs = manifest.get("fields", {})
        field = _first_difference(theirs, fields)
        if field is not None:
            raise ValueError(
                f"precompiled={folder!r} was compiled for another engine: field {field!r} is "
                f"{theirs.get(field)!r:.300} there, {fields.get(field)!r:.300} here"
            )
        return cls(pathlib.Path(folder), fields, read_only=True)

    @classmethod
    def create(cls, folder: str, fields: dict[str, str]) -> ExecutableStore:
        """A new store in ``folder`` (jaxserve compile --output): its manifest written (an
        older one replaced).

        Raises:
            OSError: the folder cannot be written.
        """
        path = pathlib.Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        _write_whole(path / MANIFEST, _canonical({"format": FORMAT, "fields": fields}))
        return cls(path, fields)

    def place_on(self, devices: Any) -> None:
        """Load executables onto ``devices`` (the engine's mesh, in order), not all of the
        process's."""
        self.devices = list(devices)

    def check(self) -> bool:
        """Whether the folder's manifest holds this store's fields (logs the first that
        differs)."""
        try:
            manifest = json.loads((self.folder / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            logger.warning("executable store %s: unreadable manifest (%s)", self.folder, e)
            return False
        if manifest.get("format") != FORMAT:
            logger.info("executable store %s: format %s, not %s", self.folder,
                        manifest.get("format"), FORMAT)  # fmt: skip
            return False
        field = _first_difference(manifest.get("fields", {}), self.fields)
        if field is not None:
            logger.info("executable store %s: field %r differs", self.folder, field)
            return False
        return True

    def fresh_compiles(self) -> contextlib.AbstractContextManager[Any]:
        """Around a compile whose executable this store will save: on the CPU, jax's persistent
        cache is bypassed in this thread, so XLA compiles it and it serializes whole (a cache
        hit would not be saved: ``save``). Elsewhere, or for a read-only store, nothing."""
        if self.read_only or self.fields.get("backend") != "cpu":
            return contextlib.nullcontext()
        try:  # private, hence guarded: where it is gone, cache hits are just not saved
            from jax._src.config import enable_compilation_cache
        except ImportError:  # pragma: no cover - depends on the installed jax
            return contextlib.nullcontext()
        return enable_compilation_cache(False)

    def has(self, name: str, signature: dict[str, str]) -> bool:
        """Whether the store holds an executable of ``name`` for ``signature``."""
        return self._path(name, signature).exists()

    def load(self, name: str, signature: dict[str, str]) -> Any | None:
        """The executable of ``name`` for arguments of ``signature``, loaded onto this
        process's devices; None when the store has none or it fails to load (logged)."""
        path = self._path(name, signature)
        if not path.exists():
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=self.devices
            )
        except Exception as e:  # any failure: compile instead
            logger.warning("%s: cannot load %s (%s: %s); compiling it", name, path.name,
                           type(e).__name__, e)  # fmt: skip
            return None
        with self._lock:
            self.num_loaded += 1
        return compiled

    def save(
        self, name: str, signature: dict[str, str], compiled: Any, from_cache: bool = False
    ) -> None:
        """Keep ``compiled`` (a jax.stages.Compiled) for the next process; a failure is logged,
        never raised (the engine runs on without it). Nothing is saved in a read-only one, nor
        an XLA:CPU executable XLA did not compile in this call (``from_cache``: jax loaded it
        from its persistent cache, or its in-memory cache returned one this process had, maybe
        so loaded): it would serialize without its kernels' object code (module docstring)."""
        if self.read_only:
            return
        if from_cache and self.fields.get("backend") == "cpu":
            logger.info("%s: not saved to the executable store: not compiled here (loaded from "
                        "jax's compilation cache; compiled next time)", name)  # fmt: skip
            return
        path = self._path(name, signature)
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
            _write_whole(path, data)
        except Exception as e:
            logger.warning("%s: cannot save its executable to %s (%s: %s)", name, path,
                           type(e).__name__, e)  # fmt: skip
            return
        with self._lock:
            self.num_saved += 1

    def _path(self, name: str, signature: dict[str, str]) -> pathlib.Path:
        slug = "".join(c if c.isalnum() else "-" for c in name)
        return self.folder / f"{slug}-{_digest(signature)}.bin"


def _write_whole(path: pathlib.Path, data: str | bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def _first_difference(a: dict[str, str], b: dict[str, str]) -> str | None:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return key
    return None


def _log_closest(root: pathlib.Path, fields: dict[str, str]) -> None:
    """Log why the stores under ``root`` of the same model do not fit (the first field that
    differs in each), e.g. a new jax version or an edited source."""
    try:
        manifests = sorted(root.glob(f"*/{MANIFEST}"))
    except OSError:
        return
    for path in manifests[:8]:
        try:
            other = json.loads(path.read_text()).get("fields", {})
        except (OSError, ValueError):
            continue
        if other.get("model") == fields["model"]:
            logger.info("executable store %s not used: field %r differs; compiling",
                        path.parent.name, _first_difference(other, fields))  # fmt: skip


def use_executable_store(
    runner: Any, cache_dir: str | None, fields: dict[str, str], precompiled: str | None = None
) -> None:
    """Give ``runner``'s step halves and block copy the ``precompiled`` folder (checked: raises as
    ExecutableStore.precompiled), else the store of ``fields`` under ``cache_dir`` (none when
    the cache is off or the store cannot be made: they compile as before)."""
    if precompiled is not None:
        store = ExecutableStore.precompiled(precompiled, fields)
    elif cache_dir is not None and _store_serves(runner.plan.platform):
        store = ExecutableStore.for_engine(cache_dir, fields)
    else:
        store = None
    if store is not None:
        if runner.sharding is not None:
            store.place_on(runner.sharding.mesh.devices.flat)
        for compiles in runner.step_compiles():
            compiles.use_store(store)


# The engine's own store on the CPU: on unless this variable is "0" (the test suite turns it off:
# its tests build many engines of equal fields, some with patched step functions). It was off
# by default while XLA:CPU executables loaded in another process failed at their first call
# ("Function ... not found"): re-serialized persistent-cache hits (ExecutableStore.save).
CPU_STORE_ENV = "JAXSERVE_CPU_EXECUTABLE_STORE"


def _store_serves(platform: str) -> bool:
    """Whether the engine's own store is used on ``platform`` (CPU_STORE_ENV)."""
    if platform != "cpu" or os.environ.get(CPU_STORE_ENV) != "0":
        return True
    logger.info("executable store off on the CPU (%s=0)", CPU_STORE_ENV)
    return False
