"""vLLM's side of bench/throughput.py: the same prompts on vLLM (its CPU backend here).

Runs under an interpreter with vLLM installed (a venv with vLLM's CPU build, made by hand) and
never imports jaxserve:

    PYTHON bench/vllm_throughput.py SPEC.json OUT.json

SPEC.json: {"model", "engine": {block_size, num_kv_blocks, bytes_per_block, max_num_seqs,
max_num_batched_tokens, max_model_len}, "temperature", "seed", "enable_prefix_caching" (default
true), "datasets": {name: [[prompt token ids, output len], ...]}}. One vLLM engine serves every
dataset in turn (its prefix cache reset in between); each dataset gets an untimed warm-up of 4
short requests, then all its requests are added at once and LLMEngine.step() is called until
they finish, with DELTA outputs so that each request's first token is timed when it reaches
this process, as on the jaxserve side. OUT.json: {"info": {...}, "datasets": {name:
{"elapsed_s", "timings", "extra"}}}.

The KV pool is the same size as jaxserve's (num_kv_blocks x bytes_per_block, passed as
kv_cache_memory_bytes); vLLM's CPU attention needs block_size a multiple of 32.
"""

from __future__ import annotations

import json
import math
import sys
import time


def _engine(spec: dict):
    from vllm import LLM

    e = spec["engine"]
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=e["block_size"],
        max_num_seqs=e["max_num_seqs"],
        max_num_batched_tokens=e["max_num_batched_tokens"],
        max_model_len=e["max_model_len"],
        kv_cache_memory_bytes=e["num_kv_blocks"] * e["bytes_per_block"],
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        seed=spec["seed"],
    )


def _run(llm, requests: list, tag: str, temperature: float) -> tuple[float, list]:
    """All requests at t = 0, stepped to completion. Returns (elapsed, per-request timings).

    No per-request seed: vLLM's CPU sampler refuses them ("CPU Generator does not use
    offset"); the engine's seed makes the run reproducible instead.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    timings = [
        {
            "prompt_len": len(p),
            "output_len": n,
            "arrival": 0.0,
            "first_token": math.nan,
            "last_useful_token": math.nan,
            "finish": math.nan,
        }
        for p, n in requests
    ]
    counts = [0] * len(requests)
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        params = SamplingParams(
            temperature=temperature,
            max_tokens=n,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            i = int(out.request_id.rsplit("-", 1)[1])
            t = timings[i]
            counts[i] += len(out.outputs[0].token_ids)
            if counts[i] and math.isnan(t["first_token"]):
                t["first_token"] = now
            if counts[i] >= t["output_len"] and math.isnan(t["last_useful_token"]):
                t["last_useful_token"] = now
            if out.finished:
                t["finish"] = now
    elapsed = time.perf_counter() - t0
    bad = [i for i, (c, t) in enumerate(zip(counts, timings, strict=True)) if c != t["output_len"]]
    if bad:
        raise RuntimeError(f"{tag}: {len(bad)} requests got the wrong number of tokens")
    return elapsed, timings


def main(spec_path: str, out_path: str) -> None:
    import vllm

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = _engine(spec)
    info = {"vllm_version": vllm.__version__, "startup_s": time.perf_counter() - t0}
    results = {}
    for name, requests in spec["datasets"].items():
        llm.reset_prefix_cache()
        warm = [(p, min(n, 8)) for p, n in requests[:4]]
        _run(llm, warm, f"{name}-warmup", spec["temperature"])
        llm.reset_prefix_cache()
        elapsed, timings = _run(llm, requests, name, spec["temperature"])
        results[name] = {"elapsed_s": elapsed, "timings": timings, "extra": {"mode": "offline"}}
        print(f"vllm {name}: {elapsed:.1f} s", file=sys.stderr, flush=True)
    with open(out_path, "w") as f:
        json.dump({"info": info, "datasets": results}, f)


if __name__ == "__main__":  # vLLM starts worker processes: the guard is required
    main(sys.argv[1], sys.argv[2])
