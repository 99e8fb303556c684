"""`jaxserve convert` under Ctrl-C, kill -9 and a dangerous --overwrite: nothing half-written
stays behind, stale staging folders are cleaned by the next conversion (never a live one's),
and the source weights are never deleted.

Ctrl-C is a real SIGINT sent to a conversion subprocess: at chosen moments (during the jaxlib
import, inside a garbage-collector callback while loading, inside the save) by a wrapper that
sends it to itself, and at a few moments spread over a run. The wrapper raises it in its own
main thread (signal.raise_signal), so Python's handler runs at the wrapper's next bytecode:
os.kill(getpid) may hand it to one of jax's threads, and the main thread then runs on a little
before it sees the interrupt (a CI run saw it only after the gc callback had returned)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxserve import cli
from jaxserve.checkpoints_tools import DTYPE_NAMES, hf_loader
from jaxserve.checkpoints_tools.convert import (
    DTYPE_CHOICES,
    EXIT_INTERRUPTED,
    convert_hf_to_orbax,
    remove_stale_siblings,
)
from jaxserve.checkpoints_tools.orbax_checkpoint import MARKER_FILE, PARAMS_DIR

pytest.importorskip("torch")
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint  # noqa: E402

TIMEOUT_S = 240  # per subprocess: a conversion of the tiny model takes a few seconds
MODULE = [sys.executable, "-m", "jaxserve.checkpoints_tools.convert"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf"), "qwen3", head_dim=32)


def _run(argv: list[str], timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


# How a wrapper script below ends: the conversion's entry point, on the script's arguments.
ENTRY_POINTS = {
    "module": "sys.exit(convert.main(sys.argv[1:]))",
    "jaxserve": "from jaxserve import cli; sys.exit(cli.main(['convert', *sys.argv[1:]]))",
}


def _wrapped(
    script: str, hf_dir: pathlib.Path, out: pathlib.Path, entry: str = "module"
) -> subprocess.CompletedProcess:
    """Run `script` as a process, then the conversion through `entry` (ENTRY_POINTS)."""
    code = script + ENTRY_POINTS[entry] + "\n"
    return _run([sys.executable, "-c", code, "--model", str(hf_dir), "--output", str(out)])


def _hidden(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _assert_interrupted_cleanly(proc: subprocess.CompletedProcess, out: pathlib.Path) -> None:
    assert proc.returncode == EXIT_INTERRUPTED, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith("convert: interrupted"), proc.stderr[-3000:]
    assert not out.exists()
    assert _hidden(out.parent) == []


# Ctrl-C while jax and jaxlib are imported (a real one there used to end as an ImportError from
# jaxlib's extension, a SIGSEGV, or be dropped by a gc callback): held until the imports finish.
_CTRL_C_DURING_JAXLIB_IMPORT = """
import signal, sys
class CtrlCWhenJaxlibLoads:
    fired = False
    def find_spec(self, name, path=None, target=None):
        if name == "jaxlib._jax" and not self.fired:
            self.fired = True
            print("sent Ctrl-C", file=sys.stderr)
            signal.raise_signal(signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlCWhenJaxlibLoads())
from jaxserve.checkpoints_tools import convert
assert "jax" not in sys.modules  # the guard is installed before jax loads
"""


@pytest.mark.slow
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_ctrl_c_during_the_jax_import_stops_with_130(hf_dir, tmp_path, entry):
    proc = _wrapped(_CTRL_C_DURING_JAXLIB_IMPORT, hf_dir, tmp_path / "orbax", entry)
    assert "sent Ctrl-C" in proc.stderr
    _assert_interrupted_cleanly(proc, tmp_path / "orbax")


# Ctrl-C whose KeyboardInterrupt Python would raise inside a garbage-collector callback (jax has
# one): gc reports it as "Exception ignored" and drops it. That is how a Ctrl-C in the first
# second of a conversion was swallowed, the conversion finishing with exit status 0.
_CTRL_C_INSIDE_GC_CALLBACK = """
import gc, os, signal, sys
from jaxserve.checkpoints_tools import convert, hf_loader
real_load = hf_loader.load_hf_checkpoint
fired = []
def ctrl_c(phase, info):
    if phase == "start" and not fired:
        fired.append(True)
        signal.raise_signal(signal.SIGINT)
        fired.append("the handler runs here, inside the callback")
def load_with_ctrl_c_in_gc(*args, **kwargs):
    gc.callbacks.append(ctrl_c)
    gc.collect()
    gc.callbacks.remove(ctrl_c)
    print("loading on", file=sys.stderr)
    return real_load(*args, **kwargs)
hf_loader.load_hf_checkpoint = load_with_ctrl_c_in_gc
"""


# Through `jaxserve convert` only: both entry points run the same run_convert under the same
# guard, and the jaxlib-import test above runs each of them into the interrupted exit.
@pytest.mark.slow
def test_ctrl_c_dropped_by_a_gc_callback_still_stops_the_conversion(hf_dir, tmp_path):
    proc = _wrapped(_CTRL_C_INSIDE_GC_CALLBACK, hf_dir, tmp_path / "orbax", "jaxserve")
    # Raised inside the callback it would be dropped with "Exception ignored": the guard raises
    # it again once the callback returned (loading went on a moment), and it stopped the run.
    assert "Exception ignored" not in proc.stderr and "loading on" in proc.stderr, proc.stderr
    _assert_interrupted_cleanly(proc, tmp_path / "orbax")


_CTRL_C_AS_THE_SAVE_STARTS = """
import signal, sys
from jaxserve.checkpoints_tools import convert, orbax_checkpoint
real_save = orbax_checkpoint.save_params
def save_with_ctrl_c(params, directory):
    signal.raise_signal(signal.SIGINT)
    real_save(params, directory)  # runs to its end: interrupting orbax leaves writer threads
    print("save finished", file=sys.stderr)
orbax_checkpoint.save_params = save_with_ctrl_c
"""


def test_ctrl_c_during_the_save_waits_for_it_then_removes_the_staging(hf_dir, tmp_path):
    proc = _wrapped(_CTRL_C_AS_THE_SAVE_STARTS, hf_dir, tmp_path / "orbax")
    assert "save finished" in proc.stderr and "Ctrl-C: stopping when" in proc.stderr
    _assert_interrupted_cleanly(proc, tmp_path / "orbax")


# A second Ctrl-C stops the save at once; orbax's writer threads then go on writing into the
# staging folder after it was removed (recreating it), as a real interrupted save did.
_CTRL_C_TWICE_IN_THE_SAVE = """
import signal, sys, threading, time
from jaxserve.checkpoints_tools import convert, orbax_checkpoint
def save_interrupted_twice(params, directory):
    def writer():
        time.sleep(0.5)
        (directory / "d").mkdir(parents=True, exist_ok=True)
        (directory / "d" / "late").write_text("written after the interrupt")
    threading.Thread(target=writer, name="like-orbax-writer").start()
    signal.raise_signal(signal.SIGINT)  # held: the save would go on
    time.sleep(0.1)  # the handler has run by the end of this
    signal.raise_signal(signal.SIGINT)  # raises KeyboardInterrupt here
    time.sleep(30)
    raise AssertionError("the second Ctrl-C did not stop the save")
orbax_checkpoint.save_params = save_interrupted_twice
"""


def test_second_ctrl_c_stops_at_once_and_late_writes_are_removed_at_exit(hf_dir, tmp_path):
    proc = _wrapped(_CTRL_C_TWICE_IN_THE_SAVE, hf_dir, tmp_path / "orbax")
    _assert_interrupted_cleanly(proc, tmp_path / "orbax")


@pytest.mark.slow
def test_ctrl_c_at_moments_spread_over_a_run(hf_dir, tmp_path):
    """A real SIGINT at a few moments of a `python -m` run: whatever the moment, the output is
    absent or complete, no staging folder remains, and an unfinished run exits with 130."""
    out = tmp_path / "orbax"
    start = time.monotonic()
    proc = _run([*MODULE, "--model", str(hf_dir), "--output", str(out)])
    duration = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "found in sys.modules" not in proc.stderr  # runpy: the package no longer imports it
    seen = []
    for fraction in (0.2, 0.45, 0.7, 0.9):
        out = tmp_path / f"orbax-{fraction}"
        child = subprocess.Popen(
            [*MODULE, "--model", str(hf_dir), "--output", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(duration * fraction)
        child.send_signal(signal.SIGINT)
        try:
            _, stderr = child.communicate(timeout=TIMEOUT_S)
        finally:
            child.kill()
        complete = (out / MARKER_FILE).is_file()
        seen.append((fraction, child.returncode, complete))
        assert _hidden(tmp_path) == [], (seen, stderr[-3000:])
        assert complete or not out.exists(), (seen, stderr[-3000:])
        if not complete:
            assert child.returncode == EXIT_INTERRUPTED, (seen, stderr[-3000:])
    assert any(rc == EXIT_INTERRUPTED for _, rc, _ in seen), seen


_KILLED_CONVERSION = """
import os, signal, sys
from jaxserve.checkpoints_tools import convert, orbax_checkpoint
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)  # the params are on disk, the marker is not
orbax_checkpoint.write_marker = killed
convert.convert_hf_to_orbax(sys.argv[1], sys.argv[2])
"""


def test_next_conversion_removes_the_staging_of_a_killed_one(hf_dir, tmp_path, caplog):
    out = tmp_path / "orbax"
    proc = _run([sys.executable, "-c", _KILLED_CONVERSION, str(hf_dir), str(out)])
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    (staged,) = tmp_path.iterdir()
    assert staged.name.startswith(".orbax.converting-") and (staged / PARAMS_DIR).is_dir()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        convert_hf_to_orbax(hf_dir, out)
    assert [p.name for p in tmp_path.iterdir()] == ["orbax"]
    assert (out / MARKER_FILE).is_file()
    assert any(f"removed {staged}" in r.getMessage() for r in caplog.records)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def _host() -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())


def _make(folder: pathlib.Path, content: str = "x") -> pathlib.Path:
    folder.mkdir()
    (folder / "file").write_text(content)
    return folder


def test_only_dead_local_writers_lose_their_staging(tmp_path, caplog):
    out = tmp_path / "orbax"
    dead, host = _dead_pid(), _host()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        stale = _make(tmp_path / f".orbax.converting-{host}-{dead}-0123abcd")
        kept = [
            _make(tmp_path / f".orbax.converting-{host}-{live.pid}-0123abcd"),  # running
            _make(tmp_path / f".orbax.converting-{host}-{os.getpid()}-0123abcd"),  # this one
            _make(tmp_path / f".orbax.converting-other_host-{dead}-0123abcd"),  # shared disk
            _make(tmp_path / ".orbax.converting-0123abcd"),  # no owner in the name
            _make(tmp_path / f".other.converting-{host}-{dead}-0123abcd"),  # another output
        ]
        with caplog.at_level(logging.WARNING, logger="jaxserve"):
            remove_stale_siblings(out)
        assert not stale.exists() and all(k.exists() for k in kept)
        assert [r.getMessage() for r in caplog.records] == [
            f"removed {stale}, left by a conversion process that is gone"
        ]
    finally:
        live.kill()
        live.wait(timeout=60)
    remove_stale_siblings(out)  # its writer is gone now
    assert not kept[0].exists()


def test_moved_aside_output_is_restored_when_the_replacement_was_killed(tmp_path, caplog):
    """Killed between moving the old output aside and renaming the new one in: the old one is
    the only copy left, so it comes back rather than being deleted."""
    out, dead, host = tmp_path / "orbax", _dead_pid(), _host()
    _make(tmp_path / f".orbax.replaced-{host}-{dead}-0123abcd", content="previous output")
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        remove_stale_siblings(out)
    assert (out / "file").read_text() == "previous output" and _hidden(tmp_path) == []
    assert "restored" in caplog.text
    # Killed after the new one was renamed in: the moved-aside one is garbage.
    moved = _make(tmp_path / f".orbax.replaced-{host}-{dead}-4567cdef", content="older")
    remove_stale_siblings(out)
    assert not moved.exists() and (out / "file").read_text() == "previous output"
    # Killed while deleting it: partial, never restored, even with no output.
    shutil.rmtree(out)
    _make(tmp_path / f".orbax.deleting-{host}-{dead}-89abcdef", content="half deleted")
    remove_stale_siblings(out)
    assert not out.exists() and _hidden(tmp_path) == []


def test_overwrite_leaves_no_sibling(hf_dir, tmp_path):
    out = convert_hf_to_orbax(hf_dir, tmp_path / "orbax")
    convert_hf_to_orbax(hf_dir, out, overwrite=True, dtype="float16")
    assert json.loads((out / MARKER_FILE).read_text())["dtype"] == "float16"
    assert [p.name for p in tmp_path.iterdir()] == ["orbax"]


@pytest.fixture()
def no_loading(monkeypatch):
    """Fail the test if the checkpoint is loaded: refusals must come first."""

    def load(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded")

    monkeypatch.setattr(hf_loader, "load_hf_checkpoint", load)


@pytest.mark.parametrize("overwrite", [True, False])
def test_output_that_is_or_contains_the_source_is_refused(hf_dir, tmp_path, no_loading, overwrite):
    source = pathlib.Path(hf_dir)
    before = sorted(p.name for p in source.iterdir())
    link = tmp_path / "link"
    link.symlink_to(source, target_is_directory=True)
    for output, what in [
        (source, "the source folder"),
        (link, "the source folder"),
        (source / ".." / source.name, "the source folder"),
        (source.parent, f"a folder containing the source folder {source}"),
    ]:
        with pytest.raises(ValueError, match=rf"--output {output} is {what}: replacing it would"):
            convert_hf_to_orbax(source, output, overwrite=overwrite)
    assert sorted(p.name for p in source.iterdir()) == before


def test_output_that_is_a_file_is_refused(hf_dir, tmp_path, no_loading):
    (tmp_path / "orbax").write_text("not a folder")
    with pytest.raises(ValueError, match="orbax exists and is not a folder"):
        convert_hf_to_orbax(hf_dir, tmp_path / "orbax", overwrite=True)


def test_cli_refuses_overwriting_the_source_with_status_2(hf_dir, no_loading, capsys):
    source = pathlib.Path(hf_dir)
    for output in (source, source.parent):
        argv = ["convert", "--model", str(source), "--output", str(output), "--overwrite"]
        assert cli.main(argv) == 2
        assert "would delete the source weights" in capsys.readouterr().err
    assert (source / "model.safetensors").is_file()


def test_output_inside_the_source_is_allowed(hf_dir, tmp_path):
    source = pathlib.Path(tmp_path / "hf")
    source.mkdir()
    for file in pathlib.Path(hf_dir).iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    out = convert_hf_to_orbax(source, source / "orbax")
    assert (out / MARKER_FILE).is_file() and (source / "model.safetensors").is_file()
    assert json.loads((out / MARKER_FILE).read_text())["source"] == str(source)


def test_importing_the_converter_loads_no_jax():
    """Its Ctrl-C guard must be in place before jax loads (see checkpoints_tools/interrupt.py);
    `jaxserve --help` stays fast too."""
    code = (
        "import sys\n"
        "import jaxserve.checkpoints_tools.convert, jaxserve.cli.convert, jaxserve.cli\n"
        "jaxserve.cli.build_parser()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'orbax'))\n"
        "assert not bad, bad[:5]\n"
    )
    proc = _run([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_dtype_choices_match_the_loader():
    assert DTYPE_CHOICES == ("auto", *DTYPE_NAMES)
