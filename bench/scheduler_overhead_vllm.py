"""Companion of bench/scheduler_overhead.py: the same workloads on vLLM V1's own Scheduler.

Runs under an interpreter that has vLLM installed (a venv with vLLM's CPU build, made by
hand), never imports jaxserve:

    PYTHON bench/scheduler_overhead_vllm.py SPECS.json

Protocol on stdin/stdout (so that its runs interleave with jaxserve's): it prints one JSON line
{"version": ...} when ready, then for each workload name read from stdin runs that workload
once on a fresh Scheduler and prints one JSON line with its timings; EOF ends it.

The Scheduler is built directly from a VllmConfig and a one-group KVCacheConfig and fed fake
ModelRunnerOutputs, the way vLLM's own scheduler unit tests drive it. The model config points
at a folder holding only a tiny Llama config.json: the scheduler never loads weights. Timing
is the same as on the jaxserve side: schedule() + update_from_output() per step, fake output
building excluded; stats logging off (vLLM's cheaper setting).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

import torch
import vllm
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

VOCAB = 32000
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def _model_config(max_model_len: int) -> ModelConfig:
    folder = tempfile.mkdtemp(prefix="tiny-llama-config-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(_TINY_LLAMA, f)
    return ModelConfig(
        model=folder,
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )


def _scheduler(spec: dict, model_config: ModelConfig) -> Scheduler:
    block_size = spec["block_size"]
    scheduler_config = SchedulerConfig(
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=spec["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    cache_config.num_gpu_blocks = spec["num_blocks"]
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=False,
    )


def _fake_runner_output(sched: Scheduler, so, step: int) -> ModelRunnerOutput:
    # vLLM advances num_computed_tokens inside schedule(); a request samples when its
    # scheduled tokens reach its last token, others get an empty list (as vLLM's runner does).
    req_ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        req_ids.append(rid)
        if req.num_computed_tokens >= req.num_tokens:
            sampled.append([(step * 31 + len(req_ids)) % (VOCAB - 1) + 1])
        else:
            sampled.append([])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def run_once(spec: dict, model_config: ModelConfig, block_hasher) -> dict:
    sched = _scheduler(spec, model_config)
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does after start-up
    arrivals: dict[int, list] = {}
    for i, r in enumerate(spec["requests"]):
        arrivals.setdefault(r["arrival"], []).append((i, r))
    warmup, steps = spec["warmup_steps"], spec["steps"]
    wall = cpu = 0.0
    scheduled = 0
    for step in range(warmup + steps):
        for i, r in arrivals.get(step, ()):
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)
            sched.add_request(
                Request(
                    str(i),
                    r["prompt"],
                    params,
                    None,
                    arrival_time=float(step),
                    block_hasher=block_hasher,
                )
            )
        t0, c0 = time.perf_counter(), time.thread_time()
        so = sched.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        mro = _fake_runner_output(sched, so, step)
        t2, c2 = time.perf_counter(), time.thread_time()
        sched.update_from_output(so, mro)
        t3, c3 = time.perf_counter(), time.thread_time()
        if step >= warmup:
            wall += (t1 - t0) + (t3 - t2)
            cpu += (c1 - c0) + (c3 - c2)
            scheduled += len(so.num_scheduled_tokens)
    gc.unfreeze()
    return {
        "wall_us": wall / steps * 1e6,
        "cpu_us": cpu / steps * 1e6,
        "mean_scheduled_reqs": scheduled / steps,
    }


def main() -> None:
    with open(sys.argv[1]) as f:
        specs = {s["name"]: s for s in json.load(f)}
    block_sizes = {s["block_size"] for s in specs.values()}
    assert len(block_sizes) == 1, block_sizes
    init_none_hash(sha256)
    block_hasher = get_request_block_hasher(block_sizes.pop(), sha256)
    model_config = _model_config(max(s["max_model_len"] for s in specs.values()))
    print(json.dumps({"version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        result = run_once(specs[line.strip()], model_config, block_hasher)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
