"""docs/architecture.md: the host side never reaches jax or flax, not even transitively; the
packages, and the layers inside jaxserve/, depend on each other only in the allowed direction
and never import each other's private names; collecting the tests builds nothing."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Modules that must load without jax/flax anywhere in sys.modules.
HOST_MODULES = [
    "jaxserve",
    "jaxserve.config",
    "jaxserve.sampling_params",
    "jaxserve.outputs",
    "jaxserve.request",
    "jaxserve.core.kv_cache_utils",
    "jaxserve.core.block_pool",
    "jaxserve.core.host_block_pool",
    "jaxserve.core.kv_swap",
    "jaxserve.core.kv_cache_manager",
    "jaxserve.core.sched.output",
    "jaxserve.core.sched.scheduler",
    "jaxserve.core.sched.preemption",
    "jaxserve.core.sched.host_kv_tier",
    "jaxserve.core.sched.starting_point",
    "jaxserve.core.sched.pending_prefixes",
    "jaxserve.core.sched.output_processor",
    "jaxserve.core.sched.spec_tokens",
    "jaxserve.core.sched.waiting",
    "jaxserve.core.sched.step_cap",
    "jaxserve.core.sched.remote_kv",
    "jaxserve.core.kv_connector.shared_storage",
    "jaxserve.core.kv_connector.remote_hits",
    "jaxserve.core.kv_connector.transfer",
    "jaxserve.kv_transfer_config",
    "jaxserve.speculative_config",
    "jaxserve.spec_decode",
    "jaxserve.engine.run_ahead",
    "jaxserve.engine.fan_out",
    "jaxserve.sampling_constraints",
    "jaxserve.structural_tag",
    "jaxserve.structured.manager",
    "jaxserve.structured.step_masks",
    "jaxserve.structured.batch_fill",
    "jaxserve.structured.draft_checks",
    "jaxserve.structured.llguidance_backend",
    # the fronts over replicas: no jax, so they never take the devices they hand out
    "jaxserve.fleet.data_parallel",
    "jaxserve.fleet.disagg",
]

# folder -> first-party packages it may import (besides itself).
ALLOWED = {
    "pallas_kernels": set(),
    "models": {"jaxserve.pallas_kernels"},
    "checkpoints_tools": {"jaxserve.models", "jaxserve.pallas_kernels"},
}


def _existing(modules: list[str]) -> list[str]:
    import importlib.util

    return [m for m in modules if importlib.util.find_spec(m) is not None]


@pytest.mark.slow
def test_host_modules_do_not_load_jax() -> None:
    modules = _existing(HOST_MODULES)
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        + "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _first_party_imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "jaxserve" or m.startswith("jaxserve.")}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_dependency_direction(folder: str) -> None:
    own = f"jaxserve.{folder}"
    allowed = ALLOWED[folder] | {own}
    for path in (ROOT / folder).rglob("*.py"):
        for module in _first_party_imports(path):
            ok = any(module == a or module.startswith(a + ".") for a in allowed)
            assert ok, f"{path.relative_to(ROOT)} imports {module}; {folder}/ may import {allowed}"


# Inside jaxserve/, from the bottom up: what each layer may not import (docs/architecture.md,
# section 2); "cli" is the package jaxserve/cli/. Imports inside functions count too.
HOST_DATA = (
    "config",
    "speculative_config",
    "kv_transfer_config",
    "sampling_params",
    "sampling_constraints",
    "structural_tag",
    "request",
    "outputs",
)
_ABOVE_CORE = {"engine", "runner", "aot", "entrypoints", "fleet", "jobs", "ray", "cli"}
FORBIDDEN = {
    "core": _ABOVE_CORE,
    "runner": _ABOVE_CORE - {"runner"},
    # the proposers and their policy: host side, below the engine that calls them
    "spec_decode": _ABOVE_CORE,
    # structured outputs' grammars, matchers and per-step masks: host side, below the engine
    "structured": _ABOVE_CORE,
    "engine": {"aot", "entrypoints", "fleet", "jobs", "ray", "cli"},
    # ahead-of-time compilation: the runner's own path for a target, below the CLI
    "aot": {"engine", "entrypoints", "fleet", "jobs", "ray", "cli"},
    "entrypoints": {"fleet", "jobs", "ray", "cli"},
    # the fronts over engine processes: HTTP and processes only, never an engine in-process
    "fleet": {"core", "runner", "engine", "aot", "jobs", "ray", "cli", "spec_decode", "structured"},
    "jobs": {"fleet", "ray", "cli"},
    # the host data modules: nothing of jaxserve but each other (and the package itself)
    **{name: _ABOVE_CORE | {"core"} for name in HOST_DATA},
}


def _layer(module: str) -> str | None:
    """The jaxserve/ layer a module belongs to: its folder or top-level module there; None
    outside jaxserve/ (jaxserve.models, jaxserve.pallas_kernels, jaxserve.checkpoints_tools) and
    for the package itself."""
    parts = module.split(".")
    if parts[0] != "jaxserve" or len(parts) < 2:
        return None
    if parts[1] in ("models", "pallas_kernels", "checkpoints_tools"):
        return None
    return parts[1]


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every first-party module ``path`` imports, ``from jaxserve import x`` as jaxserve.x."""
    found = set(_first_party_imports(path))
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "jaxserve" and node.level == 0:
            found.update(f"jaxserve.{alias.name}" for alias in node.names)
    return found


def _layer_files(layer: str) -> list[pathlib.Path]:
    package = ROOT / "jaxserve"
    if (package / layer).is_dir():
        return sorted((package / layer).rglob("*.py"))
    return [package / f"{layer}.py"] if (package / f"{layer}.py").exists() else []


def test_the_layer_of_a_module() -> None:
    assert _layer("jaxserve.cli") == _layer("jaxserve.cli.serve") == "cli"
    assert _layer("jaxserve.jobs.generate") == "jobs"
    assert _layer("jaxserve.engine.async_llm") == "engine"
    assert _layer("jaxserve.config") == "config"
    assert _layer("jaxserve") is None and _layer("jaxserve.models.decoder") is None


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_inside_jaxserve(layer: str) -> None:
    files = _layer_files(layer)
    assert files, f"jaxserve/{layer} is gone: update FORBIDDEN"
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in files
        for module in sorted(_imported_modules(path))
        if _layer(module) in FORBIDDEN[layer]
    ]
    assert not offenders, f"jaxserve/{layer} may not import {sorted(FORBIDDEN[layer])}: {offenders}"


def test_core_and_engine_have_no_direct_jax_import() -> None:
    for folder in ("jaxserve/core", "jaxserve/engine"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for name in names:
                    assert name.split(".")[0] not in ("jax", "jaxlib", "flax"), (
                        f"{path.relative_to(ROOT)} imports {name}"
                    )


def test_config_lists_every_attention_backend() -> None:
    from jaxserve.config import ATTENTION_BACKENDS
    from jaxserve.pallas_kernels.ragged_paged_attention import BACKENDS

    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS}


# Where each first-party module's source lives: a module is "inside" a package when the file
# importing it sits in the same folder.
_PACKAGE_FOLDERS = {
    "jaxserve.models": ROOT / "models",
    "jaxserve.pallas_kernels": ROOT / "pallas_kernels",
    "jaxserve.checkpoints_tools": ROOT / "checkpoints_tools",
    "jaxserve": ROOT / "jaxserve",
}


def _module_folder(module: str) -> pathlib.Path:
    for prefix, folder in _PACKAGE_FOLDERS.items():
        if module == prefix or module.startswith(prefix + "."):
            parts = module[len(prefix) :].lstrip(".").split(".")
            path = folder.joinpath(*parts)
            return path if path.is_dir() else path.parent
    raise AssertionError(module)


def test_no_private_name_is_imported_across_packages() -> None:
    """`from jaxserve.x.y import _name` only from a file in x/ itself: tests and benchmarks go
    through the public surface, and a private name may change without notice."""
    offenders = []
    for top in ("jaxserve", "models", "pallas_kernels", "checkpoints_tools", "tests", "bench"):
        for path in (ROOT / top).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                    continue
                if not (node.module == "jaxserve" or node.module.startswith("jaxserve.")):
                    continue
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private and _module_folder(node.module) != path.parent:
                    offenders.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert not offenders, offenders


def test_collecting_the_tests_builds_nothing(collection_builds: list[str]) -> None:
    """Collecting the tests (in this process: tests/conftest.py records it) compiles nothing
    with XLA and builds no C++ kernel, so it writes no cache: both are built on first use,
    when a test that needs one runs."""
    assert collection_builds == []
