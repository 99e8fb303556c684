"""bench/batch.py's paths, each run in a fresh child process (`batch.py --child KIND --spec`):
LLM.generate, `jaxserve run-batch`, `jaxserve generate --output` and Ray Data; each records its
timed part, its compilations and the token ids it generated.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

# CLI flag of each LLM keyword argument the presets use.
_FLAGS = {
    "dtype": "--dtype",
    "block_size": "--block-size",
    "num_kv_blocks": "--num-kv-blocks",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "compilation_cache_dir": "--compilation-cache-dir",
    "seed": "--seed",
}


def _compiles(engine) -> int:
    """Step compilations so far, fresh or loaded from the persistent cache (either: a new shape),
    of an LLM or an AsyncLLM (their get_stats())."""
    stats = engine.get_stats()
    return stats["num_compilations"] + stats["num_compilation_cache_hits"]


def _requests(spec: dict) -> list[tuple[list[int], int]]:
    return [
        (r["prompt_token_ids"], r["output_len"])
        for r in json.loads(Path(spec["requests"]).read_text())
    ]


def _engine_flags(engine: dict) -> list[str]:
    """The CLI flags of LLM keyword arguments."""
    flags = []
    for k, v in engine.items():
        if k == "warmup":
            flags += [] if v else ["--no-warmup"]
        else:
            flags += [_FLAGS[k], str(v)]
    return flags


def child_generate(spec: dict) -> dict:
    """The reference: LLM built (untimed), then one timed LLM.generate call."""
    t0 = time.perf_counter()
    from jaxserve import LLM, SamplingParams

    llm = LLM(spec["model"], **{"warmup": True, **spec["engine"]})  # warm before timing
    build_s = time.perf_counter() - t0
    reqs = _requests(spec)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    before = _compiles(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "build_s": build_s,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "compilations_during_run": _compiles(llm) - before,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def child_run_batch(spec: dict) -> dict:
    """`jaxserve run-batch` through jaxserve.cli.main, with two wrappers that only record: the
    job's compilations and elapsed (around jobs.run_batch.run_batch) and each request's final
    token ids (around AsyncLLM.generate; the output file has texts only)."""
    t0 = time.perf_counter()
    import jaxserve.jobs.run_batch as rb
    from jaxserve import cli
    from jaxserve.engine.async_llm import AsyncLLM

    info: dict = {}
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    original_generate, original_run_batch = AsyncLLM.generate, rb.run_batch

    async def generate(self, prompt, sampling_params, request_id, **kw):
        async for out in original_generate(self, prompt, sampling_params, request_id, **kw):
            if out.finished:
                by_prompt[tuple(out.prompt_token_ids)] = list(out.outputs[0].token_ids)
            yield out

    async def run_batch(engine, *args, **kw):
        info["startup_s"] = time.perf_counter() - t0  # imports, input, engine build
        before = _compiles(engine)
        summary = await original_run_batch(engine, *args, **kw)
        info["compilations_during_run"] = _compiles(engine) - before
        info["summary"] = dict(vars(summary))
        return summary

    AsyncLLM.generate, rb.run_batch = generate, run_batch
    rc = cli.main(
        [
            "run-batch",
            "-i",
            spec["input"],
            "-o",
            spec["output"],
            "--model",
            spec["model"],
            "--served-model-name",
            spec["served_model_name"],
            "--no-progress",
            *_engine_flags(spec["engine"]),
        ]
    )
    info["rc"] = rc
    info["token_ids"] = [by_prompt.get(tuple(ids)) for ids, _ in _requests(spec)]
    return info


def child_generate_cli(spec: dict) -> dict:
    """`jaxserve generate --input --output` through jaxserve.cli.main; the job's generate
    (jobs/generate.py) is wrapped to record the compilations of the timed part."""
    from jaxserve import cli
    from jaxserve.jobs import generate as job
    from jaxserve.jobs.job_spec import is_header

    info: dict = {}
    original = job.generate

    def generate(llm, requests, results, **kw):
        before = _compiles(llm)
        outputs, elapsed_s = original(llm, requests, results, **kw)
        info["compilations_during_run"] = _compiles(llm) - before
        info["elapsed_s_exact"] = elapsed_s
        return outputs, elapsed_s

    job.generate = generate
    rc = cli.main(
        [
            "generate",
            "--input",
            spec["input"],
            "--output",
            spec["output"],
            "--model",
            spec["model"],
            "--temperature",
            "0",
            "--ignore-eos",
            "--no-progress",
            *_engine_flags(spec["engine"]),
        ]
    )
    info["rc"] = rc
    by_id = {}
    for line in Path(spec["output"]).read_text().splitlines():
        record = json.loads(line)
        if not is_header(record):  # the job's header line comes first
            by_id[record["request_id"]] = record["token_ids"]
    info["token_ids"] = [by_id.get(f"r{i}") for i in range(len(_requests(spec)))]
    return info


def child_ray(spec: dict) -> dict:
    """build_processor(concurrency=N) over the rows on a local Ray cluster; the whole dataset
    execution is timed (actor start and engine build included)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback node address
    import ray
    import ray.data

    from jaxserve.ray import build_processor

    t0 = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=spec["ray_num_cpus"],
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=256 << 20,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    init_s = time.perf_counter() - t0
    try:
        reqs = _requests(spec)
        rows = [
            {"id": i, "prompt_token_ids": ids, "sampling_params": {"max_tokens": n}}
            for i, (ids, n) in enumerate(reqs)
        ]
        processor = build_processor(
            spec["model"],
            engine_kwargs=spec["engine"],
            sampling_params=dict(temperature=0.0, ignore_eos=True),
            concurrency=spec["concurrency"],
            batch_size=spec["batch_size"],
        )
        ds = ray.data.from_items(rows)
        start = time.perf_counter()
        out = processor(ds).take_all()
        wall = time.perf_counter() - start
    finally:
        ray.shutdown()
    by_id = {row["id"]: [int(t) for t in row["generated_token_ids"]] for row in out}
    return {
        "elapsed_s": wall,
        "ray_init_s": init_s,
        "output_tokens": sum(int(row["num_generated_tokens"]) for row in out),
        "token_ids": [by_id.get(i) for i in range(len(reqs))],
    }


CHILDREN = {
    "generate": child_generate,
    "run-batch": child_run_batch,
    "generate-cli": child_generate_cli,
    "ray": child_ray,
}


def child_main(kind: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = CHILDREN[kind](spec)
    Path(spec["result"]).write_text(json.dumps(result))
    return int(result.get("rc", 0))
