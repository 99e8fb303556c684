"""Test-session set-up shared by every test module: the platform the tests run on.

The suite runs on the CPU unless ``--platform gpu`` or ``--platform tpu`` is given (then the
tests marked ``gpu`` run natively, and expectations derived from the execution plan follow that
platform). The platform is pinned through JAX_PLATFORMS before any test module imports jax.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import traceback

import pytest

_JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
_CACHE_DIR = pytest.StashKey[str]()
# Faster XLA:CPU compilations for the tests (pytest_configure says why).
_CPU_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--platform",
        choices=sorted(_JAX_PLATFORMS),
        default="cpu",
        help="the jax platform the tests run on (default: cpu, even where a GPU is visible)",
    )


def pytest_configure(config: pytest.Config) -> None:
    platform = config.getoption("--platform")
    os.environ["JAX_PLATFORMS"] = _JAX_PLATFORMS[platform]
    # No network in tests: a model name that is not a folder must not reach the Hub (the Hub
    # tests lay out a cache folder of their own).
    os.environ["HF_HUB_OFFLINE"] = "1"
    # One persistent compilation cache for the session, shared by its workers and the
    # processes they start (engines of one configuration built again, by another test or a
    # restarted job, load their steps instead of compiling them): a fresh folder, made by the
    # controller before the workers start and removed at the end. The tests that count
    # compilations count fresh ones and cache hits together; tests of the cache itself set
    # their own folder (tests/runner/test_compile_cache.py).
    # The engine's own executable store stays off on the CPU (its tests turn it on): many
    # tests build engines of equal fields, and some patch what their steps trace, which a
    # store keyed by jaxserve's source would not see. JAXSERVE_CPU_EXECUTABLE_STORE=1 runs the
    # suite with it.
    os.environ.setdefault("JAXSERVE_CPU_EXECUTABLE_STORE", "0")
    if not hasattr(config, "workerinput"):
        folder = tempfile.mkdtemp(prefix="jaxserve-test-xla-")
        config.stash[_CACHE_DIR] = folder
        os.environ["JAXSERVE_COMPILATION_CACHE_DIR"] = folder
    if platform == "cpu":
        # The tests compile far more than they run (tiny models, a few steps per engine), and
        # LLVM's optimization is a large part of an XLA:CPU compilation: level 0 took about a
        # third off the CPU time of the engine-building tests measured (two of them). XLA:CPU's
        # MLIR fusion emitters took about half of what was left: the classic emitters halved the
        # CPU time of an engine's step compilations again (fp8 llama engine of
        # test_fp8_kv_parity: 9.1 -> 4.4 s, same tokens). One LLVM module per executable
        # instead of a split one compiled in threads: ~10% less CPU (the workers already keep
        # the cores busy). They change code generation; subprocesses inherit them. A value
        # already set wins. (At level 0 the classic emitters can round differently between
        # two programs in the last bit: tests/models/test_moe_quant.py's bit-exact check runs
        # without them.)
        flags = os.environ.get("XLA_FLAGS", "")
        for flag in _CPU_XLA_FLAGS:
            if flag.split("=")[0] not in flags:
                flags = f"{flags} {flag}".strip()
        os.environ["XLA_FLAGS"] = flags
    # jaxlib 0.10.2 miscompiles some fused CPU computations (jax-ml/jax#39103): the engine
    # applies the workaround when it is built, but a test may run jax before building one.
    from jaxserve.runner.xla_flags import apply_cpu_workarounds

    apply_cpu_workarounds()


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CACHE_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


_COLLECTION_BUILDS = pytest.StashKey[list[str]]()
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per XLA compilation
_TESTS = os.path.dirname(os.path.abspath(__file__)) + os.sep


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """Records what collecting the tests built in this process, XLA compilations and C++ CPU
    kernels (the ``collection_builds`` fixture; tests/test_import_graph.py asserts nothing):
    both are built on first use, when a test that needs one runs."""
    import jax.monitoring

    from jaxserve.pallas_kernels import cpu_ffi

    built: list[str] = []
    session.config.stash[_COLLECTION_BUILDS] = built
    build, collecting = cpu_ffi.build, threading.current_thread()

    def recorded_build(source):
        built.append(f"the C++ kernel {source.name}")
        return build(source)

    def recorded_compile(event: str, duration: float, **kwargs) -> None:
        if event == _COMPILE_EVENT and threading.current_thread() is collecting:
            here = [f for f in traceback.extract_stack() if f.filename.startswith(_TESTS)]
            where = f"{here[0].filename[len(_TESTS) :]}:{here[0].lineno}" if here else "?"
            built.append(f"an XLA compilation at {where}")

    jax.monitoring.register_event_duration_secs_listener(recorded_compile)  # kept: no removal
    cpu_ffi.build = recorded_build
    try:
        return (yield)
    finally:
        cpu_ffi.build, collecting = build, None


@pytest.fixture
def collection_builds(request: pytest.FixtureRequest) -> list[str]:
    """What collecting the tests built in this process (pytest_collection)."""
    return request.config.stash[_COLLECTION_BUILDS]


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _group_module_fixture_users(items)
    # The order in which --dist loadgroup hands out its work units (pyproject's addopts turn
    # xdist's own reordering, by number of tests, off): the marked xdist_groups first, largest
    # first (tensor parallelism's subprocess: the longest serial stretch of the suite must
    # never be its tail), then the modules grouped above, then the slow tests, then the rest,
    # each in collection order. A worker takes its next unit when it runs out, so the short
    # tests at the end even out the two workers' finishing times.
    sizes: dict[str, int] = {}
    for item in items:
        if (group := _group_of(item)) is not None:
            sizes[group] = sizes.get(group, 0) + 1

    def rank(item: pytest.Item) -> tuple[int, int]:
        group = _group_of(item)
        if group is not None:
            return (0 if not group.startswith(_MODULE_GROUP) else 1, -sizes[group])
        return (2 if item.get_closest_marker("slow") else 3, 0)

    items.sort(key=rank)
    if config.getoption("--platform") == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU: run with --platform gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_MODULE_GROUP = "module:"
_SHARED_SCOPES = ("package", "module", "class")


def _group_of(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def _group_module_fixture_users(items: list[pytest.Item]) -> None:
    """Put the tests that share a fixture instance wider than a test (module- or class-scoped,
    or session-scoped in a tests/ conftest) in one xdist_group per module, or per conftest for
    a session-scoped one, unless marked with a group of their own: --dist loadgroup hands out
    single tests otherwise, and each of the two workers that got some of them would build the
    fixture (an engine, a server, a Ray cluster, a transformers reference) again."""
    users: dict[tuple, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        indices = getattr(getattr(item, "callspec", None), "indices", {})
        for name, defs in info.name2fixturedefs.items() if info else ():
            fixture = defs[-1] if defs else None
            if fixture is None:
                continue
            if fixture.scope in _SHARED_SCOPES:
                key = ("module", _module_of(item), name, indices.get(name))
            elif fixture.scope == "session" and fixture.baseid:  # not one of pytest's own
                key = ("session", fixture.baseid, name, indices.get(name))
            else:
                continue
            users.setdefault(key, []).append(item)
    shared = [(key, group) for key, group in users.items() if len(group) > 1]
    # A module whose tests share a session-scoped fixture joins that fixture's group whole.
    group_of: dict[str, str] = {}
    for (scope, where, *_), group in shared:
        if scope == "session":
            for item in group:
                group_of[_module_of(item)] = f"{_MODULE_GROUP}{where}"
    marked: set[int] = set()
    for _, group in shared:
        for item in group:
            if id(item) not in marked:
                marked.add(id(item))
                module = _module_of(item)
                name = group_of.setdefault(module, f"{_MODULE_GROUP}{module}")
                item.add_marker(pytest.mark.xdist_group(name))


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]
