"""Convert a Hugging Face checkpoint folder into a jaxserve Orbax checkpoint folder.

    jaxserve convert --model HF_DIR --output ORBAX_DIR [--dtype bfloat16] [--quantization int8]
    python -m jaxserve.checkpoints_tools.convert --model HF_DIR --output ORBAX_DIR ...

Safe on interruption: everything is written into a hidden sibling folder
(.ORBAX_DIR.converting-<host>-<pid>-<random>) on the same filesystem, the completion marker
last, and the folder is renamed to ORBAX_DIR only then (one atomic rename). A conversion killed
at any point leaves no ORBAX_DIR, or the previous one untouched; the unfinished sibling has no
marker and is refused by the loader, and the next conversion to ORBAX_DIR removes it once the
process named in it is gone. Ctrl-C stops a conversion at any moment and leaves nothing behind
(interrupt.py). An existing ORBAX_DIR is replaced only with overwrite=True, and then only once
the new one is complete; never when it is, or contains, the source folder.

jax, orbax and the loaders are imported inside the functions that use them: the Ctrl-C guard
must be in place before they load, and `jaxserve --help` must not pay for them.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import pathlib
import re
import shutil
import socket
import sys
import uuid
from types import ModuleType
from typing import TYPE_CHECKING

from jaxserve.checkpoints_tools.interrupt import SigintGuard, sigint_guard

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.checkpoints_tools.checkpoint import LoadedCheckpoint

# Copied as they are: the architecture, generation defaults, the tokenizer and its template.
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# --dtype choices: "auto" and checkpoint.DTYPE_NAMES (spelled out: that module loads jax).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# --quantization choices: models/quant.py's QUANTIZATIONS (spelled out: that module loads jax).
QUANTIZATION_CHOICES = ("int8", "fp8")
# The shell's status for a command stopped by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
EXIT_BAD_INPUT = 2
# Hidden siblings of an output, named .OUTPUT.KIND-<host>-<pid>-<random>: "converting" is the
# staging folder; "replaced" the previous output moved aside, intact; "deleting" the previous
# output once the new one is in place, being deleted.
SIBLING_KINDS = ("converting", "replaced", "deleting")

logger = logging.getLogger("jaxserve")


def _host() -> str:
    # Letters, digits and "_" only, so the sibling's name parses back unambiguously.
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "localhost"


def _sibling(output: pathlib.Path, kind: str) -> pathlib.Path:
    """A new hidden sibling of `output` owned by this process, of a kind of SIBLING_KINDS."""
    tag = f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return output.with_name(f".{output.name}.{kind}-{tag}")


def _owner(path: pathlib.Path, output: pathlib.Path) -> tuple[str, str, int] | None:
    """(kind, host, pid) of a sibling made by _sibling for `output`; None for anything else."""
    kinds = "|".join(SIBLING_KINDS)
    pattern = rf"\.{re.escape(output.name)}\.({kinds})-(\w+)-(\d+)-[0-9a-f]{{8}}"
    match = re.fullmatch(pattern, path.name)
    return None if match is None else (match[1], match[2], int(match[3]))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by another user
    return True


def _stale_siblings(output: pathlib.Path) -> list[tuple[pathlib.Path, str]]:
    """Hidden siblings of `output` left by a conversion process of this host that is gone.

    A folder of another host (a shared filesystem) or of a live process is never returned: its
    conversion may still be running. A dead writer's PID reused since by another process keeps
    its folder until that process ends too: a leak, never a lost folder.
    """
    if not output.parent.is_dir():
        return []
    stale = []
    for path in sorted(output.parent.iterdir()):
        owner = _owner(path, output)
        if owner is not None and owner[1] == _host() and not _process_alive(owner[2]):
            stale.append((path, owner[0]))
    return stale


def remove_stale_siblings(output: str | pathlib.Path) -> None:
    """Clean up after conversions to `output` that were killed (kill -9, a crash, power loss).

    Their staging and half-deleted folders are removed. A moved-aside previous output
    (".replaced-") is removed when `output` exists (the replacement had finished), else renamed
    back to `output`: the writer was killed between its two renames, and it is the only copy.
    Each action is logged.

    Args:
        output: the conversion's output folder.
    """
    output = pathlib.Path(output)
    for path, kind in _stale_siblings(output):
        if kind == "replaced" and not output.exists():
            try:
                path.rename(output)
            except OSError:  # another conversion restored or replaced it meanwhile
                continue
            logger.warning("restored %s from %s, left by a killed conversion", output, path.name)
            continue
        shutil.rmtree(path, ignore_errors=True)  # another conversion may be removing it too
        if not path.exists():
            logger.warning("removed %s, left by a conversion process that is gone", path)


def check_output_path(source: pathlib.Path, output: pathlib.Path) -> None:
    """Refuse an output that is the source folder or contains it (replacing it would delete the
    source weights), or that is not a folder.

    Raises:
        ValueError: output is source or one of its parents (both named), or an existing file.
    """
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} exists and is not a folder")
    if not output.exists() or not source.exists():
        return
    # samefile, not path equality: a symlink, a bind mount or "a/../b" can name the same folder.
    parents = {*source.absolute().parents, *source.resolve().parents}
    if os.path.samefile(source, output):
        what = "the source folder"
    elif any(os.path.samefile(parent, output) for parent in parents):
        what = f"a folder containing the source folder {source}"
    else:
        return
    raise ValueError(
        f"--output {output} is {what}: replacing it would delete the source weights; "
        "choose another output folder"
    )


def _import_modules(guard: SigintGuard) -> tuple[ModuleType, ModuleType, ModuleType]:
    """(jax, hf_loader, orbax_checkpoint), with orbax itself imported too (~1 s in all).

    Ctrl-C is deferred meanwhile: one delivered while jaxlib's extension initialises turns into
    an ImportError or a crash instead of a KeyboardInterrupt.
    """
    with guard.deferred("the imports finish"):
        import jax
        import orbax.checkpoint  # noqa: F401  (here rather than inside the write)

        from jaxserve.checkpoints_tools import hf_loader, orbax_checkpoint
    guard.check()
    return jax, hf_loader, orbax_checkpoint


def _discard(staged: pathlib.Path) -> None:
    shutil.rmtree(staged, ignore_errors=True)
    # An interrupted or failed orbax save can leave writer threads running that recreate files
    # in `staged`; Python waits for them before running atexit functions: remove it again then.
    atexit.register(shutil.rmtree, staged, ignore_errors=True)


def _replace_folder(staged: pathlib.Path, output: pathlib.Path, overwrite: bool) -> None:
    """Rename the finished `staged` folder to `output`, moving an existing `output` aside first
    (a folder cannot be renamed over a non-empty one) and deleting it after.

    Raises:
        FileExistsError: `output` appeared meanwhile and overwrite is False.
    """
    if not output.exists():
        staged.rename(output)
        return
    if not overwrite:
        raise FileExistsError(f"{output} was created during the conversion; not replaced")
    old = _sibling(output, "replaced")
    output.rename(old)
    staged.rename(output)
    # Renamed before deleting, so that a "replaced" folder is always whole: a kill during the
    # deletion must not leave a partial folder that remove_stale_siblings would restore.
    doomed = old.rename(_sibling(output, "deleting"))
    shutil.rmtree(doomed)


def _write_staged(
    ckpt: LoadedCheckpoint, source: pathlib.Path, staged: pathlib.Path, orbax_ckpt: ModuleType
) -> None:
    """Fill `staged`: the copied files, the params, the marker last."""
    import jax

    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, staged / name)
    orbax_ckpt.save_params(ckpt.params, staged / orbax_ckpt.PARAMS_DIR)
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(ckpt.params))
    orbax_ckpt.write_marker(
        staged,
        dtype=ckpt.dtype,
        source=str(source),
        num_params=num_params,
        quantization=ckpt.quantization,
    )


def _publish(
    ckpt: LoadedCheckpoint,
    source: pathlib.Path,
    output: pathlib.Path,
    overwrite: bool,
    guard: SigintGuard,
    orbax_ckpt: ModuleType,
) -> None:
    """Write the staging folder and rename it to `output`; on any exception remove it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = _sibling(output, "converting")
    # A Ctrl-C waits for the step in progress: interrupting orbax's save would leave its writer
    # threads writing into `staged` after it was removed.
    with guard.deferred(f"{staged} is written; it is then removed"):
        staged.mkdir()
        try:
            _write_staged(ckpt, source, staged, orbax_ckpt)
            guard.check()  # the last moment Ctrl-C stops the conversion: nothing replaced yet
            _replace_folder(staged, output, overwrite)
        except BaseException:
            _discard(staged)
            raise


def convert_hf_to_orbax(
    model: str | pathlib.Path,
    output: str | pathlib.Path,
    *,
    dtype: str = "auto",
    overwrite: bool = False,
    quantization: str | None = None,
) -> pathlib.Path:
    """Convert the HF checkpoint folder `model` into an Orbax checkpoint folder `output`.

    The weights pass through host memory (the CPU device), never an accelerator. Stale siblings
    of `output` left by killed conversions are cleaned up first (remove_stale_siblings).

    Args:
        model: the Hugging Face checkpoint folder.
        output: the folder to write.
        dtype: the stored params dtype: "auto" (the checkpoint's own), "float32", "bfloat16"
            or "float16".
        overwrite: replace an existing `output` (only once the new one is complete).
        quantization: None (the checkpoint's own precision: an FP8 / int8 checkpoint stays
            8-bit), or "int8" / "fp8": store the decoder's linear weights quantized
            (load_hf_checkpoint's quantization); the marker records it.

    Returns:
        The output folder.

    Raises:
        FileExistsError: `output` exists and overwrite is False.
        ValueError / FileNotFoundError: `output` is or contains the source folder (checked
            before anything is loaded); as load_hf_checkpoint (bad folder, tensor, dtype).
        KeyboardInterrupt: Ctrl-C (in the main thread); nothing is left behind, and `output`
            is untouched unless the interrupt came after it was complete (then a warning).
    """
    source, output = pathlib.Path(model), pathlib.Path(output)
    check_output_path(source, output)
    with sigint_guard() as guard:
        jax, hf_loader, orbax_ckpt = _import_modules(guard)
        remove_stale_siblings(output)
        if output.exists() and not overwrite:
            raise FileExistsError(
                f"{output} exists; pass --overwrite (overwrite=True) to replace it"
            )
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        ckpt = hf_loader.load_hf_checkpoint(
            source, dtype=dtype, param_sharding=lambda path: cpu, quantization=quantization
        )
        guard.check()  # a Ctrl-C dropped during loading (interrupt.py) stops here
        _publish(ckpt, source, output, overwrite, guard, orbax_ckpt)
        if guard.interrupted:
            logger.warning("Ctrl-C came after %s was complete: it is kept", output)
            raise KeyboardInterrupt
    return output


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the conversion's flags (--model, --output, --dtype, --overwrite) to `parser`."""
    parser.add_argument("--model", required=True, metavar="HF_DIR", help="HF checkpoint folder")
    parser.add_argument("--output", required=True, metavar="ORBAX_DIR", help="folder to write")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="stored params dtype"
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        help="store the decoder's linear weights in 8 bits: int8 or fp8 (e4m3), per output "
        "channel (default: the checkpoint's own precision)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")


def run_convert(args: argparse.Namespace, prog: str = "jaxserve convert") -> int:
    """Run a conversion from parsed arguments.

    Returns:
        The exit code: 0, 2 for bad input, 130 when stopped by Ctrl-C.
    """
    with sigint_guard() as guard:
        try:
            out = convert_hf_to_orbax(
                args.model,
                args.output,
                dtype=args.dtype,
                overwrite=args.overwrite,
                quantization=args.quantization,
            )
        except BaseException as e:
            # Whatever the interrupt became on its way (an ImportError inside an extension's
            # initialisation, an error in an orbax thread), it is an interrupt.
            if guard.interrupted or isinstance(e, KeyboardInterrupt):
                print(f"{prog}: interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            if isinstance(e, (FileExistsError, FileNotFoundError, TypeError, ValueError)):
                print(f"{prog}: error: {e}", file=sys.stderr)
                return EXIT_BAD_INPUT
            raise
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxserve.checkpoints_tools.convert`: the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxserve.checkpoints_tools.convert", description=__doc__.split("\n")[0]
    )
    add_convert_arguments(parser)
    return run_convert(parser.parse_args(argv), prog=parser.prog)


if __name__ == "__main__":
    sys.exit(main())
