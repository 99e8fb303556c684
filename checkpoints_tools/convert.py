"""Convert a Hugging Face checkpoint folder into a jaxserve Orbax checkpoint folder.

    jaxserve convert --model HF_DIR --output ORBAX_DIR [--dtype bfloat16] [--overwrite]
    python -m jaxserve.checkpoints_tools.convert --model HF_DIR --output ORBAX_DIR ...

Safe on interruption: everything is written into a hidden sibling folder
(.ORBAX_DIR.converting-<random>) on the same filesystem, the completion marker last, and the
folder is renamed to ORBAX_DIR only then (one atomic rename). A conversion killed at any point
leaves no ORBAX_DIR, or the previous one untouched; the unfinished sibling has no marker and is
refused by the loader. An existing ORBAX_DIR is replaced only with overwrite=True, and then
only once the new one is complete.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import uuid

import jax

from jaxserve.checkpoints_tools.checkpoint import DTYPE_NAMES
from jaxserve.checkpoints_tools.hf_loader import load_hf_checkpoint
from jaxserve.checkpoints_tools.orbax_checkpoint import PARAMS_DIR, save_params, write_marker

# Copied as they are: the architecture, generation defaults, the tokenizer and its template.
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _replace_folder(staged: pathlib.Path, output: pathlib.Path) -> None:
    """Rename the finished `staged` folder to `output`, moving an existing `output` aside first
    (a folder cannot be renamed over a non-empty one) and deleting it after."""
    if not output.exists():
        staged.rename(output)
        return
    old = output.with_name(f".{output.name}.replaced-{uuid.uuid4().hex[:8]}")
    output.rename(old)
    staged.rename(output)
    shutil.rmtree(old)


def convert_hf_to_orbax(
    model: str | pathlib.Path,
    output: str | pathlib.Path,
    *,
    dtype: str = "auto",
    overwrite: bool = False,
) -> pathlib.Path:
    """Convert the HF checkpoint folder `model` into an Orbax checkpoint folder `output`.

    The weights pass through host memory (the CPU device), never an accelerator.

    Args:
        dtype: the stored params dtype: "auto" (the checkpoint's own), "float32", "bfloat16"
            or "float16".
        overwrite: replace an existing `output` (only once the new one is complete).

    Returns:
        The output folder.

    Raises:
        FileExistsError: `output` exists and overwrite is False.
        ValueError / FileNotFoundError: as load_hf_checkpoint (bad folder, tensor, dtype).
    """
    source, output = pathlib.Path(model), pathlib.Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite (overwrite=True) to replace it")
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    ckpt = load_hf_checkpoint(source, dtype=dtype, param_sharding=lambda path: cpu)
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.with_name(f".{output.name}.converting-{uuid.uuid4().hex[:8]}")
    staged.mkdir()
    try:
        for name in COPIED_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, staged / name)
        save_params(ckpt.params, staged / PARAMS_DIR)
        num_params = sum(x.size for x in jax.tree_util.tree_leaves(ckpt.params))
        write_marker(staged, dtype=ckpt.dtype, source=str(source), num_params=num_params)
        _replace_folder(staged, output)
    except BaseException:
        # An exception (Ctrl-C included) leaves nothing behind; a killed process leaves the
        # hidden, marker-less folder, which the loader refuses.
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return output


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="HF_DIR", help="HF checkpoint folder")
    parser.add_argument("--output", required=True, metavar="ORBAX_DIR", help="folder to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES])
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")


def run_convert(args: argparse.Namespace, prog: str = "jaxserve convert") -> int:
    """Run a conversion from parsed arguments; the exit code (2 for bad input)."""
    try:
        out = convert_hf_to_orbax(
            args.model, args.output, dtype=args.dtype, overwrite=args.overwrite
        )
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
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
