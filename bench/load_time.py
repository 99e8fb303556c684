"""Time to first token from a cold process: safetensors vs Orbax, on the same checkpoint.

A Llama-shaped random checkpoint of ~50M parameters (D 512, L 8, N 8, K 2, F 1024, V 32000) is
written with transformers (checkpoints_tools.testing.write_tiny_hf_checkpoint) and converted to
an Orbax checkpoint (checkpoints_tools.convert). Each measurement is a fresh Python process:

    spawn -> `from jaxserve import LLM` -> LLM(model) (load + KV pool) -> first generated token

timed from just before the spawn (so interpreter start and imports count). The two formats
alternate, run after run, so drift on a shared machine hits both alike. Each format is measured
once untimed first (so both read from a warm OS page cache: this measures the loader, not the
disk). The table shows medians and minima over runs, and the load step (LLM construction)
alone; the first token includes the step's compilation, the same for both.

    python bench/load_time.py [--runs 5] [--dtype float32] [--tensor-parallel-size 1]

Writes bench/results/load_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "load_time.json"
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    max_position_embeddings=2048,
    initializer_range=0.02,
)
# No warm-up: this measures the loader (bench/startup.py measures warm-up and the cache).
ENGINE = dict(
    num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, warmup=False
)

# Runs in the measured process; argv: model, dtype, tensor_parallel_size, engine JSON.
_CHILD = """
import json, sys, time
t = {"start": time.time()}
from jaxserve import LLM, SamplingParams
t["imported"] = time.time()
llm = LLM(sys.argv[1], dtype=sys.argv[2], tensor_parallel_size=int(sys.argv[3]),
          **json.loads(sys.argv[4]))
t["loaded"] = time.time()
out = llm.generate([[1, 100, 200, 300]], SamplingParams(max_tokens=1, temperature=0.0),
                   use_tqdm=False)
t["first_token"] = time.time()
assert len(out[0].outputs[0].token_ids) == 1
print("TIMES " + json.dumps(t))
"""


def measure(model: Path, dtype: str, tp: int) -> dict[str, float]:
    """One cold process: seconds from spawn to import done, to loaded, to the first token."""
    env = dict(os.environ)
    if tp > 1 and "device_count" not in env.get("XLA_FLAGS", ""):
        flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}"
        env["XLA_FLAGS"] = flags.strip()
    spawn = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), dtype, str(tp), json.dumps(ENGINE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measurement of {model} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TIMES "))
    t = json.loads(line[len("TIMES ") :])
    return {
        "process_start_s": t["start"] - spawn,
        "import_s": t["imported"] - spawn,
        "load_s": t["loaded"] - t["imported"],
        "ttft_s": t["first_token"] - spawn,
    }


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def prepare(work: Path, dtype: str) -> tuple[Path, Path, int, float]:
    """(HF folder, Orbax folder, parameter count, conversion seconds)."""
    from jaxserve.checkpoints_tools.convert import convert_hf_to_orbax
    from jaxserve.checkpoints_tools.load import load_arch
    from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint
    from jaxserve.models import get_model

    hf = write_tiny_hf_checkpoint(work / "hf", "llama", **SHAPE)
    start = time.perf_counter()
    orbax = convert_hf_to_orbax(hf, work / "orbax", dtype=dtype)
    convert_s = time.perf_counter() - start
    return hf, orbax, get_model(load_arch(hf)).num_params(), convert_s


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = runs[0].keys()
    out = {f"{k}_median": statistics.median(r[k] for r in runs) for k in keys}
    out |= {f"{k}_min": min(r[k] for r in runs) for k in keys}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf, orbax, num_params, convert_s = prepare(Path(tmp), args.dtype)
        formats = {"safetensors": hf, "orbax": orbax}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in formats}
        for folder in formats.values():  # untimed: warm the page cache for both
            measure(folder, args.dtype, args.tensor_parallel_size)
        for _ in range(args.runs):
            for name, folder in formats.items():
                runs[name].append(measure(folder, args.dtype, args.tensor_parallel_size))
        sizes = {name: folder_bytes(folder) for name, folder in formats.items()}
    summary = {name: summarize(r) for name, r in runs.items()}
    print(
        f"{num_params / 1e6:.1f}M params, {args.dtype}, tp={args.tensor_parallel_size}, "
        f"{args.runs} runs, conversion {convert_s:.2f} s"
    )
    print(
        f"{'format':<12} {'MB':>6} {'ttft med':>9} {'ttft min':>9} {'load med':>9} "
        f"{'load min':>9} {'import':>7}"
    )
    for name, s in summary.items():
        print(
            f"{name:<12} {sizes[name] / 1e6:6.0f} {s['ttft_s_median']:9.2f} {s['ttft_s_min']:9.2f}"
            f" {s['load_s_median']:9.2f} {s['load_s_min']:9.2f} {s['import_s_median']:7.2f}"
        )
    ratio = summary["safetensors"]["load_s_median"] / summary["orbax"]["load_s_median"]
    print(f"load step: safetensors / orbax = {ratio:.2f}x (medians)")
    result = {
        "benchmark": "load_time",
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "model": {"family": "llama", **SHAPE, "num_params": num_params, "dtype": args.dtype},
        "engine": ENGINE,
        "tensor_parallel_size": args.tensor_parallel_size,
        "conversion_s": convert_s,
        "bytes_on_disk": sizes,
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
