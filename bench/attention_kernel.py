"""Benchmark of ragged paged attention: every implementation the registry runs here, side by side.

Decode: batch x context grid (one query token per sequence), at each of the preset's page sizes;
prefill: chunked-prefill and mixed batches. Each implementation (--backends: registry names,
resolved by ``select_attention`` for this device, the preset's shapes and the case's page size)
is timed on every case; a case reports the kernel's time, the K/V bytes it must read divided by
that time (achieved bytes/s) against a device-to-device copy bandwidth measured in the same run,
and the speedup over (and the max abs difference from) the jnp reference on the same batch.
An implementation the registry refuses here, or that fails to compile or run, is an error row;
the other rows are still measured. Prints a table and writes JSON (--out, rewritten after every
row, so a run cut short by a time limit keeps what it measured).

    python bench/attention_kernel.py --preset h200-decode --out a.json   # the GPU check (< 1 min)
    python bench/attention_kernel.py --preset h200 --out attention.json  # the full GPU sweep
    python bench/attention_kernel.py --preset cpu-smoke --out /tmp/a.json    # seconds, on CPU
    python bench/attention_kernel.py --backends xla,pallas_triton --page-sizes 16,32

Default backends: on GPU xla (the baseline), pallas_triton, pallas_mosaic_gpu (in that order:
a kernel that hangs is cut off by the caller's time limit after the others' rows are written);
on TPU xla, pallas_tpu; on CPU xla and pallas_triton (in Pallas interpret mode). "auto" names
the engine's own choice. On GPU and TPU an implementation that would only run in interpret mode
is an error row, not a measurement.

Each timed program runs the op `inner` times back to back inside one jit (each call's input
depends on the previous output, so nothing is hoisted or overlapped), which keeps Python
dispatch out of the per-call time, as in a model step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _attention_kernel_cases import References, backend_cases  # noqa: E402
from _attention_kernel_presets import DEFAULT_BACKENDS, PRESETS  # noqa: E402
from _attention_kernel_recorder import Recorder  # noqa: E402
from _attention_kernel_timing import copy_bandwidths  # noqa: E402

from jaxserve.pallas_kernels.ragged_paged_attention import device_facts  # noqa: E402


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", default=None, help="JSON output path (rewritten after each row)")
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated registry names (or 'auto'); default: every kernel of this "
        "platform and xla (GPU: xla,pallas_triton,pallas_mosaic_gpu)",
    )
    parser.add_argument(
        "--page-sizes", default=None, help="decode page sizes, e.g. 16,32 (default: the preset's)"
    )
    opts = parser.parse_args(argv)
    preset = PRESETS[opts.preset]
    if opts.page_sizes:
        preset = dataclasses.replace(preset, page_sizes=_int_list(opts.page_sizes))
    device = jax.devices()[0]
    platform = device_facts(device)["platform"]
    if opts.backends:
        backends = tuple(b.strip() for b in opts.backends.split(",") if b.strip())
    else:
        backends = DEFAULT_BACKENDS[platform]
    print(
        f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"backends: {', '.join(backends)}"
    )
    header = dict(
        preset=opts.preset,
        device=device.device_kind,
        platform=jax.default_backend(),
        jax_version=jax.__version__,
        # The Pallas kernel family of this platform, and whether it is interpreted here (the
        # fields of the single-kernel version of this benchmark).
        kernel="tpu" if platform == "tpu" else "gpu",
        interpret=platform == "cpu",
        backends=list(backends),
        config=dataclasses.asdict(preset),
    )
    recorder = Recorder(header, opts.out, copy_bandwidths(preset))
    references = References(preset)
    for name in backends:
        backend_cases(preset, name, recorder, references)
    result = recorder.finish()
    if opts.out:
        print(f"wrote {opts.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
