"""Serialized executables (runner/executable_store.py): a second process loads every step
without tracing it and generates the same tokens; anything that does not match, or fails to
load, compiles instead (logged)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.executable_store import CPU_STORE_ENV, ExecutableStore, engine_fields

FIELDS = dict(devices=jax.devices()[:1], arch=None, plan={"a": 1}, engine={"n": 2})


def _fields(**changes):
    from jaxserve.checkpoints_tools.tiny_random import tiny_random_llama_arch

    return engine_fields(**{**FIELDS, "arch": tiny_random_llama_arch(), **changes})


def _compiled():
    fn = jax.jit(lambda x, y: (x + y, x * 2), donate_argnums=0)
    args = (jnp.ones(4), np.arange(4, dtype=np.float32))
    return fn.lower(*args).compile(), args


def test_round_trip_and_misses(tmp_path, caplog):
    compiled, args = _compiled()
    sig = {"x": "float32[4]", "y": "float32[4]"}
    store = ExecutableStore.for_engine(str(tmp_path), _fields())
    assert not store.has("f", sig) and store.load("f", sig) is None
    store.save("f", sig, compiled)
    again = ExecutableStore.for_engine(str(tmp_path), _fields())
    assert again.folder == store.folder and again.has("f", sig)
    loaded = again.load("f", sig)
    x = jnp.full(4, 3.0)
    out = loaded(x, args[1])
    np.testing.assert_array_equal(out[0], [3, 4, 5, 6])
    assert x.is_deleted()  # donation survives serialization
    assert not again.has("f", {**sig, "y": "float32[8]"})  # another signature
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        other = ExecutableStore.for_engine(str(tmp_path), _fields(plan={"a": 2}))
    assert other.folder != store.folder and not other.has("f", sig)
    assert "field 'plan' differs" in caplog.text
    # A corrupt file: not loaded, logged, compiled by the caller.
    next(store.folder.glob("f-*.bin")).write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert again.load("f", sig) is None
    assert "cannot load" in caplog.text


def test_other_xla_flags_are_another_store(tmp_path, caplog, monkeypatch):
    """XLA_FLAGS change the code XLA generates: executables compiled under others are not used."""
    store = ExecutableStore.for_engine(str(tmp_path), _fields())
    monkeypatch.setenv(
        "XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false"
    )
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        other = ExecutableStore.for_engine(str(tmp_path), _fields())
    assert other.folder != store.folder
    assert "field 'xla_flags' differs; compiling" in caplog.text


def test_a_manifest_of_other_fields_is_refused(tmp_path, caplog):
    store = ExecutableStore.for_engine(str(tmp_path), _fields())
    manifest = store.folder / "manifest.json"
    data = json.loads(manifest.read_text())
    data["fields"]["jaxlib"] = "0.0.1"
    manifest.write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        assert ExecutableStore.for_engine(str(tmp_path), _fields()) is None
    assert "field 'jaxlib' differs" in caplog.text


def _same_program():
    """A new function object each call, of the same program: jax traces, lowers and compiles
    it again (its in-memory caches are per function), so its persistent cache serves it."""

    def f(x):
        return (x.astype(jnp.bfloat16) * 3).astype(jnp.float32) + 1

    return jax.jit(f)


def test_what_the_store_saves_was_compiled_not_loaded_from_jax_cache(tmp_path):
    """XLA:CPU serializes an executable it deserialized (a persistent cache hit) without its
    kernels' object code: loaded again, it fails at its first call ("Function ... not
    found"). Warm-up compiles what the store saves past jax's cache, and the store refuses a
    cache hit."""
    from jaxserve.runner.compile_cache import enable_compilation_cache
    from jaxserve.runner.step_compiles import StepCompiles, signature

    if enable_compilation_cache() is None:  # the suite's folder, as an engine sets it
        pytest.skip("the persistent compilation cache is off")
    x = jnp.arange(6, dtype=jnp.float32)
    args, names, sig = (x,), ("x",), {"x": "float32[6]"}
    hit = _same_program().lower(*args).compile()  # in jax's cache now (or already)
    hit = _same_program().lower(*args).compile()  # loaded from it
    store = ExecutableStore.for_engine(str(tmp_path), _fields())
    store.save("hit", sig, hit, from_cache=True)
    assert store.num_saved == 0 and not store.has("hit", sig)
    compiles = StepCompiles("f")
    compiles.use_store(store)
    compiles.lower(_same_program(), args, names).compile()
    compiles.save_ran()
    assert compiles.num_fresh == 1 and compiles.num_cache_hits == 0  # compiled, not loaded
    assert store.has("f", signature(args, names, {}))
    np.testing.assert_array_equal(store.load("f", sig)(x), x * 3 + 1)  # its code came along


def test_an_executable_this_process_already_had_is_not_saved(tmp_path):
    """Two engines of the same shapes in one process (a notebook, a benchmark): the first's
    block copy is a persistent cache hit; the second lowers the same jitted function, and jax's
    in-memory cache hands back that loaded executable with no compilation event at all. The
    store must not save it either (it did: the next process failed, "Function ... not
    found"). Whether the first was a cache hit or not, the second did not compile: it is not
    saved."""
    from jaxserve.runner.step_compiles import StepCompiles, signature

    fn = _same_program()  # one function object, as a module-level jitted step
    x = jnp.arange(6, dtype=jnp.float32)
    args, names = (x,), ("x",)
    first = StepCompiles("first")
    first.lower(fn, args, names).compile()  # a persistent-cache hit where the cache holds it
    assert first.num_cache_hits + first.num_fresh == 1
    store = ExecutableStore.for_engine(str(tmp_path), _fields())
    second = StepCompiles("second")
    second.use_store(store)
    second.lower(fn, args, names).compile()  # jax's in-memory cache: the loaded one
    second.save_ran()
    assert store.num_saved == 0 and not store.has("second", signature(args, names, {}))


SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from jaxserve import LLMEngine, SamplingParams
from jaxserve.models import CausalLM
calls = []
forward = CausalLM.forward
CausalLM.forward = lambda self, *a, **k: calls.append(1) or forward(self, *a, **k)
engine = LLMEngine("tiny-random-llama", num_kv_blocks=16, block_size=8, max_model_len=32,
                   max_num_batched_tokens=8, max_num_seqs=2)
traced = len(calls)
engine.add_request("a", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], SamplingParams(max_tokens=6, n=2))
while engine.has_unfinished_requests():
    done = [o for o in engine.step() if o.finished]
    if done:
        tokens = [c.token_ids for c in done[0].outputs]
stats = engine.get_stats()
print(json.dumps({"fresh": stats["num_compilations"], "hits": stats["num_compilation_cache_hits"],
                  "traced": traced, "tokens": tokens, "after": stats["recompilations"]}))
"""


def _run(env: dict[str, str]) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.slow
def test_a_second_process_loads_every_step_without_tracing(tmp_path):
    env = {"JAXSERVE_COMPILATION_CACHE_DIR": str(tmp_path), CPU_STORE_ENV: "1"}
    first, _ = _run(env)
    assert first["fresh"] > 0 and first["traced"] > 0
    second, _ = _run(env)
    assert second["traced"] == 0 and second["fresh"] == 0  # loaded, never traced
    assert second["hits"] == first["fresh"] + first["hits"]
    assert second["tokens"] == first["tokens"] and second["after"] == []
    # (A store of other fields is not used, and the engine compiles instead: the unit tests
    # above and below; an engine compiling is every other test.)


@pytest.mark.slow
def test_precompiled_folder_loads_and_a_foreign_one_is_refused(tmp_path, monkeypatch):
    """LLM(precompiled=DIR) with a folder in `jaxserve compile --output`'s format (here an
    engine's own store, copied: the same format, CPU executables) loads every step; one
    compiled for another engine is refused before anything runs, naming the field."""
    import shutil

    from jaxserve import LLMEngine, SamplingParams

    monkeypatch.setenv(CPU_STORE_ENV, "1")  # the engine's own store, on the CPU
    engine_args = dict(num_kv_blocks=16, block_size=8, max_model_len=32,
                       max_num_batched_tokens=8, max_num_seqs=2)  # fmt: skip
    first = LLMEngine("tiny-random-llama", **engine_args)
    store = first.runner.forward_compiles.store
    folder = tmp_path / "precompiled"
    shutil.copytree(store.folder, folder)
    total = len(list(folder.glob("*.bin")))
    runner = first.runner
    assert total == runner.warmup_set().num_step_compilations(runner.plan.fused_step)
    engine = LLMEngine("tiny-random-llama", precompiled=str(folder), **engine_args)
    stats = engine.get_stats()
    assert stats["num_compilations"] == 0 and stats["num_compilation_cache_hits"] == total
    assert engine.runner.forward_compiles.store.read_only
    params = SamplingParams(max_tokens=5, temperature=0.0)
    for e in (first, engine):
        e.add_request("a", [5, 6, 7, 8, 9, 10], params)
    outs = []
    for e in (first, engine):
        while e.has_unfinished_requests():
            outs += [o.outputs[0].token_ids for o in e.step() if o.finished]
    assert outs[0] == outs[1] and engine.get_stats()["recompilations"] == []
    with pytest.raises(ValueError, match="field 'engine' is .* there"):
        LLMEngine("tiny-random-llama", precompiled=str(folder), **{**engine_args,
                  "num_kv_blocks": 24})  # fmt: skip
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        LLMEngine("tiny-random-llama", precompiled=str(tmp_path), **engine_args)
