"""End to end on one GPU: jaxserve on a Llama-3-8B-shaped checkpoint against transformers.

    python bench/gpu_e2e.py --out e2e.json                      # llama3-8b preset, on the GPU
    python bench/gpu_e2e.py --preset tiny --out /tmp/e2e.json   # seconds, on CPU (tests)
    python bench/gpu_e2e.py --checkpoint-only                   # only write the checkpoint

Phases, each measured and written into the JSON (--out, rewritten after every phase, so a run
cut short keeps what it measured):

    checkpoint  a random-weight bf16 checkpoint in Hugging Face layout (config.json, sharded
                safetensors + index), Llama-3-8B's shape: hidden 4096, 32 layers, 32 heads,
                8 KV heads, intermediate 14336, vocab 128256, max_position_embeddings 8192
                (--layers for fewer layers). Written directly with numpy (no torch model:
                instantiating 8B parameters in torch would take minutes), once, into --cache;
                reused when present. Weights are normal(0, 0.02) drawn from one pool of random
                bf16 values (each tensor starts at its own offset), norms 1. No tokenizer: the
                prompts are token ids.
    cold        a fresh process: LLM(model=..., dtype="bfloat16") built without warm-up, then
                every step bucket compiled (the runner's warmup, one bucket at a time, each
                timed): cold_start_s = construct (load, plan, KV cache) + warmup, with jax's
                persistent compilation cache pointed at an empty folder (--compile-cache, set
                by this script: jax_compilation_cache_dir). Then, in the same process, the
                offline throughput run: --num-requests ShareGPT-like requests (bench/_datasets:
                sharegpt_like), all submitted at once, ignore_eos and temperature 1.0 so that
                every engine generates exactly the same lengths; output tokens/s, and the
                engine's get_stats() (the execution plan included). Should compiling run so
                long that less than Preset.run_reserve_s is left, the warm-up stops there (the
                JSON says so) and the run compiles the rest; a run still going at the deadline
                is cut, and the tokens generated so far count (complete: false).
    hf          transformers `generate` on the same GPU (torch, bf16, SDPA attention), static
                batches of --hf-batch-size in request order, left-padded, each batch
                generating its longest output (min_new_tokens = max_new_tokens, sampled at
                temperature 1.0); only each request's own output length counts as useful
                tokens. Static batching needs the batch's longest output per batch, so
                transformers runs a fixed subset, the first --hf-num-requests requests, and
                reports tokens/s on that subset; `generate(max_time=...)` stops it at the
                phase's deadline, and then the tokens done so far count (the JSON says so).
    warm        a third fresh process, the same construction and warm-up, now served by the
                persistent compilation cache the cold process filled: warm_start_s; then a
                short generate as a check that the loaded executables run. Last, so that it
                gets whatever time the others left.

Summary: cold and warm start, jaxserve's output tokens/s, transformers' output tokens/s on its
subset, their ratio, and vLLM's published 6,583 output tok/s for Llama-3.1-8B on one GPU (a
constant for context, labelled published: not measured here, other hardware and workload).

Time: every phase after the checkpoint runs in its own process with a deadline inside
--budget-s; the later phases' minimum is kept back (Preset.reserve_s), a phase may have a cap
(Preset.cap_s), and a process that overruns is killed, its partial result kept (a SIGTERM to
this process, a caller's time limit, also writes what was measured). See bench/gpu_check.sh
for the budget on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _datasets  # noqa: E402
from _metrics import ModelShape, RequestTiming, utilization  # noqa: E402

DEFAULT_CACHE = HERE / ".cache" / "gpu_e2e"
MARKER = "bench_checkpoint.json"  # written last: the checkpoint is complete
PAD_ID = 0

# Context for the summary, not a measurement of this run.
PUBLISHED_VLLM = {
    "output_tokens_per_s": 6583.0,
    "model": "Llama-3.1-8B",
    "devices": "one GPU",
    "label": "published by vLLM, not measured here (other hardware, workload and settings)",
}


@dataclass(frozen=True)
class Preset:
    """A model shape, an engine configuration, a workload and a time plan that belong together."""

    name: str
    model: dict  # HF config.json fields
    engine: dict  # LLM(...) keyword arguments besides model, dtype, warmup
    num_requests: int
    dataset_kw: dict = field(default_factory=dict)  # sharegpt_like options
    hf_num_requests: int = 64  # the fixed subset transformers runs
    hf_batch_size: int = 64
    dtype: str = "bfloat16"
    shard_bytes: int = 4 << 30  # safetensors shard size
    budget_s: float = 600.0  # default --budget-s
    # Seconds kept back for each later phase (its minimum), and the most a phase may take.
    reserve_s: dict = field(default_factory=lambda: {"hf": 75.0, "warm": 60.0})
    cap_s: dict = field(default_factory=lambda: {"hf": 90.0})
    min_phase_s: float = 20.0  # a phase with less time than this is skipped
    run_reserve_s: float = 45.0  # the cold phase stops compiling buckets to keep this for its run
    warmup_requests: int = 4  # untimed requests before the timed run (host paths, sampler)
    check_requests: int = 8  # the warm phase's short generate


LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=False,
    initializer_range=0.02,
    bos_token_id=128000,
    eos_token_id=128001,
    dtype="bfloat16",
    torch_dtype="bfloat16",
    use_cache=True,
)

PRESETS = {
    "llama3-8b": Preset(
        name="llama3-8b",
        model=LLAMA3_8B,
        engine=dict(
            block_size=16,
            max_model_len=2048,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
        ),
        num_requests=512,
        hf_num_requests=64,
        hf_batch_size=64,
    ),
    # For tests/bench: the same code path on CPU in seconds.
    "tiny": Preset(
        name="tiny",
        model=dict(
            LLAMA3_8B,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
        ),
        engine=dict(
            block_size=16,
            max_model_len=64,
            max_num_seqs=4,
            max_num_batched_tokens=4,  # token buckets 1 and 4: four compilations in all
            num_kv_blocks=64,
        ),
        num_requests=8,
        dataset_kw=dict(mean_input=12, mean_output=8, max_prompt_len=32, max_total_len=64),
        hf_num_requests=8,
        hf_batch_size=4,
        dtype="float32",  # XLA:CPU compiles the float32 step faster; the GPU runs bfloat16
        shard_bytes=40_000,  # several shards and an index, as the 8B checkpoint has
        budget_s=300.0,
        reserve_s={"hf": 40.0, "warm": 40.0},
        min_phase_s=10.0,
        run_reserve_s=5.0,
        warmup_requests=2,
        check_requests=2,
    ),
}


# ---- the checkpoint ----------------------------------------------------------------------


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint with this config, HF names and [out, in] layouts."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    n, k = cfg["num_attention_heads"] * h, cfg["num_key_value_heads"] * h
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (n, d)),
            (p + "self_attn.k_proj.weight", (k, d)),
            (p + "self_attn.v_proj.weight", (k, d)),
            (p + "self_attn.o_proj.weight", (d, n)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f)),
        ]
    out.append(("model.norm.weight", (d,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, d)))
    return out


def _bf16_pool(num: int, std: float, seed: int) -> np.ndarray:
    """``num`` normal(0, std) values as bfloat16 bit patterns (uint16): the top half of each
    float32, rounded to nearest even."""
    x = np.random.default_rng(seed).standard_normal(num, dtype=np.float32) * np.float32(std)
    bits = x.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


_BF16_ONE = 0x3F80


class _TensorSource:
    """The bytes of each tensor: norms all ones, the rest a window of one random pool (an odd
    length, so rows never repeat in step), starting at a per-tensor offset."""

    def __init__(self, std: float, seed: int, pool_size: int) -> None:
        self.pool = _bf16_pool(pool_size | 1, std, seed)
        self.rng = np.random.default_rng(seed + 1)

    def write(self, f, name: str, numel: int) -> None:
        if name.endswith("norm.weight"):
            f.write(np.full(numel, _BF16_ONE, np.uint16).tobytes())
            return
        size = len(self.pool)
        pos = int(self.rng.integers(size))
        left = numel
        while left:
            n = min(left, size - pos)
            f.write(memoryview(self.pool[pos : pos + n]))
            left -= n
            pos = 0


def _shards(tensors: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list]:
    shards, current, size = [], [], 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    return shards


def _write_safetensors(path: Path, tensors: list, source: _TensorSource) -> int:
    """One safetensors file of bf16 tensors (header, then the data in header order)."""
    header, offset = {}, 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in tensors:
            source.write(f, name, math.prod(shape))
    return offset


def checkpoint_folder(cache: Path, preset: Preset, cfg: dict) -> Path:
    return cache / f"{preset.name}-L{cfg['num_hidden_layers']}"


def read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(folder: Path) -> None:
    """Free the disk before writing: a checkpoint of another config in ``folder``, and staging
    folders left by writers that were killed."""
    if folder.exists():
        shutil.rmtree(folder)
    for staging in folder.parent.glob(f".{folder.name}.partial-*"):
        pid = staging.name.rsplit("-", 1)[1]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def ensure_checkpoint(folder: Path, cfg: dict, preset: Preset, seed: int = 0) -> dict:
    """The checkpoint in ``folder``: reused when its marker matches ``cfg``, else written
    (staged in a sibling folder, renamed when complete). Returns what the JSON records."""
    marker = read_marker(folder)
    if marker is not None and marker.get("config") == cfg:
        return dict(marker.get("written", {}), reused=True, path=str(folder))
    tensors = tensor_shapes(cfg)
    total = sum(2 * math.prod(s) for _, s in tensors)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(folder)
    free = shutil.disk_usage(folder.parent).free
    if free < total * 1.05 + (64 << 20):
        raise RuntimeError(
            f"not enough disk space for the checkpoint in {folder.parent}: {total / 1e9:.1f} GB "
            f"needed, {free / 1e9:.1f} GB free (set --cache elsewhere)"
        )
    staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    t0 = time.perf_counter()
    largest = max(math.prod(s) for _, s in tensors)
    source = _TensorSource(cfg.get("initializer_range", 0.02), seed, min(largest, 1 << 25))
    pool_s = time.perf_counter() - t0
    shards = _shards(tensors, preset.shard_bytes)
    if len(shards) == 1:
        _write_safetensors(staging / "model.safetensors", shards[0], source)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(staging / name, shard, source)
            weight_map.update({t: name for t, _ in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (staging / "config.json").write_text(json.dumps(cfg, indent=1))
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=1))
    write_s = time.perf_counter() - t0
    written = dict(
        write_s=write_s,
        random_pool_s=pool_s,
        bytes=total,
        write_Bps=total / write_s,
        num_files=len(shards),
        num_params=total // 2,
    )
    (staging / MARKER).write_text(json.dumps({"config": cfg, "written": written}, indent=1))
    staging.rename(folder)
    return dict(written, reused=False, path=str(folder))


# ---- phases run in child processes ----------------------------------------------------------


class _Result(dict):
    """A child's result, rewritten (atomically) at every milestone."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def save(self) -> None:
        _write_json(self.path, self)


def _write_json(path: str | Path, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def _start_jax(compile_cache: str) -> None:
    """Apply the CPU workaround (before jax starts its backends) and point jax's persistent
    compilation cache at ``compile_cache``, caching every compilation."""
    from jaxserve.runner.xla_flags import apply_cpu_workarounds

    apply_cpu_workarounds()
    import jax

    jax.config.update("jax_compilation_cache_dir", compile_cache)
    for name, value in (
        ("jax_persistent_cache_min_compile_time_secs", 0.0),
        ("jax_persistent_cache_min_entry_size_bytes", 0),
    ):
        try:
            jax.config.update(name, value)
        except (AttributeError, KeyError, ValueError):  # a jax without that option
            pass


class _CacheHits:
    """Compilations loaded from the persistent cache in this process (jax monitoring events)."""

    def __init__(self) -> None:
        import jax

        self.count = 0
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.count += 1


def _device_info() -> dict:
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    return dict(
        jax_version=jax.__version__,
        platform=dev.platform,
        device_kind=dev.device_kind,
        bytes_limit=stats.get("bytes_limit"),
        peak_bytes_in_use=stats.get("peak_bytes_in_use"),
    )


def _build_and_warm(spec: dict, res: _Result, *, stop_for_run_s: float | None) -> object:
    """LLM(...) without warm-up, then the runner's warmup one bucket at a time (each timed).
    With stop_for_run_s, warming stops when less than that is left before the deadline (the
    rest compiles during the run, which says so)."""
    t_spawn, deadline = spec["t_spawn"], spec["deadline"]
    res["started_after_spawn_s"] = time.time() - t_spawn
    t0 = time.perf_counter()
    _start_jax(spec["compile_cache"])
    hits = _CacheHits()
    from jaxserve import LLM

    res["import_s"] = time.perf_counter() - t0
    res["status"] = "constructing"
    res.save()
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], warmup=False, **spec["engine"])
    res["construct_s"] = time.perf_counter() - t0
    res["construct_compilations"] = llm.engine.runner.num_compilations
    res["device"] = _device_info()
    res["status"] = "warming up"
    res.save()
    runner = llm.engine.runner
    shapes = list(runner.buckets.all_shapes())
    res["num_buckets"] = len(shapes)
    res["buckets"] = []
    t_warm = time.perf_counter()
    for shape in shapes:
        left = deadline - time.time()
        if stop_for_run_s is not None and left < stop_for_run_s:
            res["warmup_stopped"] = f"{left:.0f} s left before the deadline: kept for the run"
            break
        t = time.perf_counter()
        before, before_hits = runner.num_compilations, hits.count
        runner.warmup([shape])
        res["buckets"].append(
            dict(
                tokens=shape[0],
                rows=shape[1],
                width=shape[2],
                seconds=time.perf_counter() - t,
                compilations=runner.num_compilations - before,  # fresh ones, as the engine counts
                cache_hits=hits.count - before_hits,  # loaded from the persistent cache
            )
        )
        res.save()
    res["warmup_s"] = time.perf_counter() - t_warm
    res["warmup_complete"] = len(res["buckets"]) == len(shapes)
    res["warmup_compilations"] = sum(b["compilations"] for b in res["buckets"])
    res["warmup_cache_hits"] = sum(b["cache_hits"] for b in res["buckets"])
    res["start_s"] = res["construct_s"] + res["warmup_s"]  # construct + warmup
    res["ready_after_spawn_s"] = time.time() - t_spawn  # process start, imports included
    res["cache_hits_total"] = hits.count
    res["status"] = "ready"
    res.save()
    return llm


def _requests(spec: dict) -> list[_datasets.BenchRequest]:
    return [_datasets.BenchRequest(ids, n) for ids, n in spec["requests"]]


def _params(r: _datasets.BenchRequest, seed: int, max_tokens: int | None = None):
    from jaxserve import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens or r.output_len, temperature=1.0, ignore_eos=True, seed=seed
    )


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = np.asarray(values) * 1e3
    return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}


def _step_until_done(
    engine, ids: list[str], deadline: float, res: _Result, before: int
) -> tuple[dict[str, int], dict[str, float], bool, float]:
    """Step the engine until its requests (`ids`) finish or `deadline` (time.time()) is 3 s
    away, saving progress in `res` every 5 s (compilations counted from `before`).

    Returns:
        (output tokens per request id, finish time (s from the first step) per finished id,
        whether the run was cut at the deadline, seconds elapsed).
    """
    runner = engine.runner
    generated = dict.fromkeys(ids, 0)
    finish: dict[str, float] = {}
    truncated = False
    t0 = last_save = time.perf_counter()
    while engine.has_unfinished_requests():
        # finished_only: what LLM.generate reads (no RequestOutput per running request).
        for out in engine.step(finished_only=True):
            generated[out.request_id] = len(out.outputs[0].token_ids)
            finish[out.request_id] = time.perf_counter() - t0
        if time.perf_counter() - last_save > 5:  # progress, in case the process is killed
            last_save = time.perf_counter()
            res["run_progress"] = dict(
                seconds=last_save - t0,
                num_finished=len(finish),
                num_output_tokens_of_finished=sum(generated.values()),
                compilations=runner.num_compilations - before,
            )
            res.save()
        if time.time() > deadline - 3 and engine.has_unfinished_requests():
            # Out of time: one more step reports every running request's tokens so far.
            for out in engine.step():
                generated[out.request_id] = len(out.outputs[0].token_ids)
            truncated = True
            break
    return generated, finish, truncated, time.perf_counter() - t0


def child_cold(spec: dict, res: _Result) -> None:
    """Cold start, then the offline throughput run (see the module docstring)."""
    llm = _build_and_warm(spec, res, stop_for_run_s=spec["run_reserve_s"])
    engine, runner = llm.engine, llm.engine.runner
    requests = _requests(spec)
    # Untimed: a few short requests touch every host path once (the baseline gets one too);
    # not when compiling left no time for it.
    small = requests[: spec["warmup_requests"]] if res["warmup_complete"] else []
    before = runner.num_compilations
    t0 = time.perf_counter()
    if small:
        llm.generate(
            [r.prompt_token_ids for r in small],
            [_params(r, i, min(r.output_len, 8)) for i, r in enumerate(small)],
            use_tqdm=False,
        )
    res["warmup_run_s"] = time.perf_counter() - t0
    res["warmup_run_compilations"] = runner.num_compilations - before
    res["status"] = "running"
    res.save()

    before = runner.num_compilations
    ids = [f"bench-{i}" for i in range(len(requests))]
    for rid, (i, r) in zip(ids, enumerate(requests), strict=True):
        engine.add_request(rid, r.prompt_token_ids, _params(r, spec["seed"] + i))
    generated, finish, truncated, elapsed = _step_until_done(
        engine, ids, spec["deadline"], res, before
    )
    stats = llm.get_stats()
    num_out = sum(generated.values())
    num_in = sum(r.prompt_len for r in requests)
    run = dict(
        num_requests=len(requests),
        num_finished=len(finish),
        complete=not truncated,
        elapsed_s=elapsed,
        num_prompt_tokens=num_in,
        num_output_tokens=num_out,
        num_output_tokens_requested=sum(r.output_len for r in requests),
        output_tokens_per_s=num_out / elapsed,
        total_tokens_per_s=(num_in + num_out) / elapsed if not truncated else None,
        requests_per_s=len(finish) / elapsed,
        e2e_latency_ms=_percentiles(list(finish.values())),
        compilations_during_run=runner.num_compilations - before,
        mode="offline, every request at t=0, engine.step(finished_only=True)",
    )
    if not truncated:
        shape = ModelShape.from_hf_config(spec["model_config"])
        shape = dataclasses.replace(shape, bytes_per_param=2)
        timings = [RequestTiming(r.prompt_len, r.output_len) for r in requests]
        run.update(utilization(shape, timings, elapsed, stats.get("num_steps"), {}))
    res["run"] = run
    res["stats"] = stats
    res["device"] = _device_info()
    res["status"] = "done" if not truncated else "run cut at the deadline"
    res.save()


def child_warm(spec: dict, res: _Result) -> None:
    """Warm start from the persistent compilation cache, then a short generate."""
    llm = _build_and_warm(spec, res, stop_for_run_s=None)
    requests = _requests(spec)[: spec["check_requests"]]
    before = llm.engine.runner.num_compilations
    t0 = time.perf_counter()
    outs = llm.generate(
        [r.prompt_token_ids for r in requests],
        [_params(r, i, min(r.output_len, 16)) for i, r in enumerate(requests)],
        use_tqdm=False,
    )
    res["check_generate"] = dict(
        num_requests=len(requests),
        num_output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
        seconds=time.perf_counter() - t0,
        compilations=llm.engine.runner.num_compilations - before,
    )
    res["stats"] = llm.get_stats()
    res["status"] = "done"
    res.save()


def _hf_import_and_load(spec: dict, res: _Result) -> tuple[Any, Any, str]:
    """Import torch and transformers and load the checkpoint, timing each in `res`.

    Returns:
        (the torch module, the model, its device: "cuda" or "cpu").
    """
    res["started_after_spawn_s"] = time.time() - spec["t_spawn"]
    t0 = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    res["import_s"] = time.perf_counter() - t0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res.update(
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        status="loading",
    )
    res.save()
    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    model = _hf_load(AutoModelForCausalLM, spec["model_dir"], spec["dtype"], device, torch, res)
    res["load_s"] = time.perf_counter() - t0
    res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    res["status"] = "warming up"
    res.save()
    return torch, model, device


def child_hf(spec: dict, res: _Result) -> None:
    """transformers `generate` on a fixed subset (see the module docstring)."""
    deadline = spec["deadline"]
    torch, model, device = _hf_import_and_load(spec, res)
    requests = _requests(spec)[: spec["hf_num_requests"]]
    batch_size = spec["hf_batch_size"]
    gen_kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=PAD_ID)
    t0 = time.perf_counter()
    _hf_generate(model, requests[:2], 4, gen_kw, device, torch, None)
    res["warmup_s"] = time.perf_counter() - t0
    res["status"] = "running"
    res.save()

    useful = generated = done_requests = 0
    truncated = False
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        max_new = max(r.output_len for r in batch)
        left = deadline - 3 - time.time()
        if left <= 1:
            truncated = True
            break
        steps = _hf_generate(model, batch, max_new, gen_kw, device, torch, left)
        useful += sum(min(r.output_len, steps) for r in batch)
        generated += steps * len(batch)
        if steps < max_new:
            truncated = True
            break
        done_requests += len(batch)
    elapsed = time.perf_counter() - t0
    res["run"] = dict(
        num_requests=len(requests),
        num_requests_total=spec["num_requests_total"],
        subset="the first hf_num_requests requests of the same list, in request order",
        num_requests_finished=done_requests,
        batch_size=batch_size,
        complete=not truncated,
        truncated_by_time=truncated,
        elapsed_s=elapsed,
        num_output_tokens=useful,  # each request's own output length (or what was done)
        num_generated_tokens=generated,  # padding to each batch's longest included
        output_tokens_per_s=useful / elapsed if elapsed > 0 else None,
        mode="static batches, left padding, min_new_tokens = max_new_tokens = batch's longest",
    )
    if device == "cuda":
        res["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    res["status"] = "done" if not truncated else "run cut at the deadline"
    res.save()


def _hf_load(auto_cls, model_dir: str, dtype: str, device: str, torch, res: dict):
    """The checkpoint in ``dtype`` on ``device``: straight onto the GPU where this transformers
    can (device_map needs accelerate), else through host memory."""
    want = getattr(torch, dtype)
    res["load_path"] = "from_pretrained, then .to(device)"
    model = None
    if device != "cpu":
        try:
            model = auto_cls.from_pretrained(model_dir, dtype=want, device_map=device)
            res["load_path"] = "from_pretrained(device_map=device)"
        except (ImportError, ValueError) as e:  # no accelerate
            res["device_map_refused"] = f"{type(e).__name__}: {e}"[:300]
    if model is None:
        model = auto_cls.from_pretrained(model_dir, dtype=want)
    if model.dtype != want:  # a transformers that took dtype= for something else
        model = model.to(want)
    return model.to(device).eval()


def _hf_generate(model, batch, max_new: int, gen_kw: dict, device: str, torch, max_time) -> int:
    """Generate for one left-padded batch; returns the number of new tokens per row."""
    longest = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding: the prompt ends at the last column
        ids[i, longest - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[i, longest - r.prompt_len :] = 1
    extra = {} if max_time is None else {"max_time": float(max_time)}
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            **gen_kw,
            **extra,
        )
    if device == "cuda":
        torch.cuda.synchronize()
    return int(out.shape[1] - longest)


CHILDREN = {"cold": child_cold, "warm": child_warm, "hf": child_hf}
# In this order: transformers before the warm start, so that the warm start (the least
# important figure, and the one that takes what it takes) gets the time left over.
PHASES = ("cold", "hf", "warm")


def child_main(phase: str, spec_path: str, result_path: str) -> NoReturn:
    spec = json.loads(Path(spec_path).read_text())
    res = _Result(result_path)
    res.update(phase=phase, status="starting")
    res.save()
    try:
        CHILDREN[phase](spec, res)
        code = 0
    except BaseException as e:  # recorded, then the process fails
        res["status"] = "failed"
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-6000:]
        res.save()
        traceback.print_exc()
        code = 1
    # Skip the interpreter's teardown (freeing tens of GB of device buffers one by one): the
    # result is written, and the phase's time limit should not be spent on the exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the orchestrating process ------------------------------------------------------------


class _Terminated(Exception):
    """SIGTERM (a caller's time limit): write what was measured, then exit."""


def _on_sigterm(signum, frame) -> None:
    # Once: `timeout` signals both this process and its process group.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated()


def _run_child(phase: str, spec: dict, out_dir: Path, timeout_s: float, report: dict) -> dict:
    """Run one phase in a fresh process with a deadline; returns its result (partial if it
    overran) and records the phase's status, wall time and exit code in the report."""
    spec_path = out_dir / f"e2e_{phase}_spec.json"
    result_path = out_dir / f"e2e_{phase}.json"
    log_path = out_dir / f"e2e_{phase}.log"
    result_path.unlink(missing_ok=True)
    spec = dict(spec, t_spawn=time.time(), deadline=time.time() + timeout_s - 5)
    _write_json(spec_path, spec)
    info = dict(timeout_s=round(timeout_s, 1), log=str(log_path), status="running")
    report["phases"][phase] = info
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", phase]
    cmd += ["--spec", str(spec_path), "--result", str(result_path)]
    t0 = time.perf_counter()
    print(f"[e2e] {phase}: up to {timeout_s:.0f} s (log {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout_s)
            info["status"] = "ok" if code == 0 else "failed"
            info["exit_code"] = code
        except subprocess.TimeoutExpired:
            info["status"] = "timeout"
            proc.kill()
            proc.wait()
        except BaseException:
            info["status"] = "terminated"
            proc.kill()
            proc.wait()
            raise
        finally:
            info["wall_s"] = round(time.perf_counter() - t0, 2)
            try:
                result = json.loads(result_path.read_text())
            except (OSError, ValueError):
                result = {}
            spec_path.unlink(missing_ok=True)
            report["results"][phase] = result
    if info["status"] != "ok":
        tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
        print(f"[e2e] {phase}: {info['status']}; log tail:\n{tail}", flush=True)
    return result


def build_summary(report: dict) -> dict:
    """The headline numbers (None where a phase did not get that far)."""
    res = report["results"]
    cold, warm, hf = res.get("cold", {}), res.get("warm", {}), res.get("hf", {})
    run, hf_run = cold.get("run", {}), hf.get("run", {})
    js_tps, hf_tps = run.get("output_tokens_per_s"), hf_run.get("output_tokens_per_s")
    plan = (cold.get("stats") or {}).get("plan") or {}
    out = dict(
        cold_start_s=cold.get("start_s"),
        cold_ready_after_spawn_s=cold.get("ready_after_spawn_s"),
        cold_construct_s=cold.get("construct_s"),
        cold_warmup_s=cold.get("warmup_s"),
        cold_warmup_complete=cold.get("warmup_complete"),
        warmup_compilations=cold.get("warmup_compilations"),
        warm_start_s=warm.get("start_s"),
        warm_ready_after_spawn_s=warm.get("ready_after_spawn_s"),
        warm_construct_s=warm.get("construct_s"),
        warm_warmup_s=warm.get("warmup_s"),
        warm_cache_hits=warm.get("warmup_cache_hits"),
        warm_compilations=warm.get("warmup_compilations"),
        attention=plan.get("attention"),
        jaxserve_output_tokens_per_s=js_tps,
        jaxserve_num_requests=run.get("num_requests"),
        jaxserve_run_complete=run.get("complete"),
        jaxserve_compilations_during_run=run.get("compilations_during_run"),
        hf_output_tokens_per_s=hf_tps,
        hf_num_requests=hf_run.get("num_requests"),
        hf_run_complete=hf_run.get("complete"),
        jaxserve_over_hf=js_tps / hf_tps if js_tps and hf_tps else None,
        jaxserve_over_hf_basis=(
            "jaxserve on every request, transformers on its subset (output tokens/s each)"
        ),
        vllm_published_output_tokens_per_s=PUBLISHED_VLLM["output_tokens_per_s"],
        jaxserve_over_vllm_published=(
            js_tps / PUBLISHED_VLLM["output_tokens_per_s"] if js_tps else None
        ),
    )
    return out


def _fmt(value, spec: str = ".1f", unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:{spec}}{unit}"


def print_table(report: dict) -> None:
    s = report["summary"]
    rows = [
        (
            "checkpoint",
            _fmt(report["checkpoint"].get("write_s"), ".1f", " s write")
            + (" (reused)" if report["checkpoint"].get("reused") else ""),
        ),
        (
            "cold start (construct + warmup)",
            _fmt(s["cold_start_s"], ".1f", " s")
            + f"  ({_fmt(s['cold_construct_s'])} + {_fmt(s['cold_warmup_s'])} s, "
            f"{_fmt(s['warmup_compilations'], 'd')} compilations"
            + (", warm-up cut short)" if s["cold_warmup_complete"] is False else ")"),
        ),
        (
            "warm start (construct + warmup)",
            _fmt(s["warm_start_s"], ".1f", " s")
            + f"  ({_fmt(s['warm_construct_s'])} + {_fmt(s['warm_warmup_s'])} s, "
            f"{_fmt(s['warm_cache_hits'], 'd')} cache hits)",
        ),
        (
            "jaxserve output tok/s",
            _fmt(s["jaxserve_output_tokens_per_s"])
            + f"  ({_fmt(s['jaxserve_num_requests'], 'd')} requests, complete: "
            f"{_fmt(s['jaxserve_run_complete'])}, attention {s['attention'] or '-'})",
        ),
        (
            "transformers output tok/s",
            _fmt(s["hf_output_tokens_per_s"])
            + f"  ({_fmt(s['hf_num_requests'], 'd')} requests, complete: "
            f"{_fmt(s['hf_run_complete'])})",
        ),
        ("jaxserve / transformers", _fmt(s["jaxserve_over_hf"], ".2f", "x")),
        (
            "vLLM published (not measured)",
            _fmt(s["vllm_published_output_tokens_per_s"], ".0f")
            + f" tok/s; jaxserve / that {_fmt(s['jaxserve_over_vllm_published'], '.2f', 'x')}",
        ),
    ]
    print("\n" + "\n".join(f"  {name:34s} {value}" for name, value in rows), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--hf-num-requests", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--engine-json", default=None, help="LLM keyword overrides, as JSON")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="checkpoint cache folder")
    p.add_argument("--out", default="gpu_e2e.json", help="JSON report (per-phase files beside)")
    p.add_argument("--compile-cache", default=None, help="default: <out dir>/jax_compile_cache")
    p.add_argument("--budget-s", type=float, default=None, help="wall-time budget of the run")
    p.add_argument("--phases", default="cold,hf,warm", help="which of cold,hf,warm to run")
    p.add_argument("--checkpoint-only", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.spec, args.result)
    t_start = time.perf_counter()
    preset = PRESETS[args.preset]
    budget = args.budget_s if args.budget_s is not None else preset.budget_s
    deadline = time.time() + budget
    cfg = dict(preset.model)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out_dir = out.parent
    compile_cache = Path(args.compile_cache or out_dir / "jax_compile_cache")
    report: dict = dict(
        preset=preset.name,
        complete=False,
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        budget_s=budget,
        machine=dict(hostname=platform.node(), cpus=os.cpu_count()),
        published=PUBLISHED_VLLM,
        phases={},
        results={},
    )
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _run(args, preset, cfg, out, out_dir, compile_cache, deadline, report)
        report["complete"] = not args.checkpoint_only and all(
            p.get("status") == "ok" for p in report["phases"].values()
        )
    except _Terminated:
        report["terminated"] = "SIGTERM (the caller's time limit)"
        report["summary"] = build_summary(report)
        report["wall_s"] = time.perf_counter() - t_start
        _write_json(out, report)
        sys.exit(124)
    finally:
        signal.signal(signal.SIGTERM, previous)
    report["wall_s"] = time.perf_counter() - t_start
    if not args.checkpoint_only:
        report["summary"] = build_summary(report)
    _write_json(out, report)
    if not args.checkpoint_only:
        print_table(report)
    print(f"wrote {out}", flush=True)
    return report


def _checkpoint_phase(folder: Path, cfg: dict, preset: Preset, seed: int, report: dict) -> bool:
    """Write (or reuse) the random checkpoint in `folder`, recorded in report["checkpoint"] and
    its phase; returns False when it could not be written (no disk space, an unwritable
    cache): then nothing can run."""
    print(f"[e2e] checkpoint {folder} ...", flush=True)
    t0 = time.perf_counter()
    try:
        report["checkpoint"] = dict(ensure_checkpoint(folder, cfg, preset, seed))
    except (OSError, RuntimeError) as e:  # no disk space, an unwritable cache: nothing to run
        error = f"{type(e).__name__}: {e}"
        report["checkpoint"] = dict(error=error)
        report["phases"]["checkpoint"] = dict(status="failed", error=error)
        print(f"[e2e] checkpoint: FAILED: {error}", flush=True)
        return False
    report["checkpoint"]["phase_s"] = time.perf_counter() - t0
    report["phases"]["checkpoint"] = dict(status="ok", wall_s=round(time.perf_counter() - t0, 2))
    ck = report["checkpoint"]
    print(
        f"[e2e] checkpoint: {ck['bytes'] / 1e9:.2f} GB, "
        + ("reused" if ck["reused"] else f"written in {ck['write_s']:.1f} s"),
        flush=True,
    )
    return True


def _run(args, preset, cfg, out, out_dir, compile_cache, deadline, report) -> None:
    folder = checkpoint_folder(Path(args.cache), preset, cfg)
    shape = ModelShape.from_hf_config(cfg)
    report["model"] = dict(
        config=cfg,
        num_params=dataclasses.replace(shape, bytes_per_param=2).num_params,
        checkpoint_dir=str(folder),
    )
    if not _checkpoint_phase(folder, cfg, preset, args.seed, report):
        return
    _write_json(out, report)
    if args.checkpoint_only:
        return

    n = args.num_requests or preset.num_requests
    dataset = _datasets.sharegpt_like(n, cfg["vocab_size"], seed=args.seed, **preset.dataset_kw)
    report["dataset"] = dataset.summary()
    engine = dict(preset.engine, **json.loads(args.engine_json or "{}"))
    spec = dict(
        model_dir=str(folder),
        model_config=cfg,
        dtype=preset.dtype,
        engine=engine,
        compile_cache=str(compile_cache),
        requests=[[r.prompt_token_ids, r.output_len] for r in dataset.requests],
        num_requests_total=n,
        seed=args.seed,
        run_reserve_s=preset.run_reserve_s,
        warmup_requests=preset.warmup_requests,
        check_requests=preset.check_requests,
        hf_num_requests=min(args.hf_num_requests or preset.hf_num_requests, n),
        hf_batch_size=args.hf_batch_size or preset.hf_batch_size,
    )
    report["engine"] = engine
    report["compile_cache"] = str(compile_cache)
    phases = [p for p in PHASES if p in args.phases.split(",")]
    if "cold" in phases:  # cold means an empty persistent cache
        shutil.rmtree(compile_cache, ignore_errors=True)
    compile_cache.mkdir(parents=True, exist_ok=True)
    for i, phase in enumerate(phases):
        kept = sum(preset.reserve_s.get(p, 0.0) for p in phases[i + 1 :])
        timeout = min(deadline - time.time() - kept, preset.cap_s.get(phase, math.inf))
        if timeout < preset.min_phase_s:
            report["phases"][phase] = dict(status="skipped", reason=f"{timeout:.0f} s left")
            print(f"[e2e] {phase}: skipped, {timeout:.0f} s left", flush=True)
            continue
        _run_child(phase, spec, out_dir, timeout, report)
        report["summary"] = build_summary(report)
        _write_json(out, report)
    report["compile_cache_bytes"] = sum(
        f.stat().st_size for f in compile_cache.rglob("*") if f.is_file()
    )
    report["summary"] = build_summary(report)


if __name__ == "__main__":
    main(sys.argv[1:])
