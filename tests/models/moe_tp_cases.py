"""Tensor-parallel MoE run, as a script in a fresh process with 4 simulated CPU devices.

    python tests/models/moe_tp_cases.py WORK_DIR RESULTS.json

XLA_FLAGS must hold --xla_force_host_platform_device_count=4 before jax starts, hence a
separate process; test_moe.py runs it and checks the JSON it writes: for tp 1, 2 and 4, the
greedy tokens of a tiny Mixtral (4 experts, top-2, expert F = 32) and the spec and device 0's
shard shape of layer 0's experts_gate, experts_down and router.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint


def _layout(llm: LLM) -> dict[str, dict[str, object]]:
    moe = llm.engine.runner.params["layers_0"]["moe"]
    out = {}
    for name in ("experts_gate", "experts_down", "router"):
        x = moe[name]
        out[name] = {
            "spec": [None if a is None else str(a) for a in x.sharding.spec],
            "shard_shape": list(x.addressable_shards[0].data.shape),
        }
    return out


def main(work: pathlib.Path, out: pathlib.Path) -> None:
    folder = write_tiny_hf_checkpoint(work / "mixtral", "mixtral", with_tokenizer=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for tp in (1, 2, 4):
        llm = LLM(
            str(folder),
            dtype="float32",
            tensor_parallel_size=tp,
            block_size=16,
            num_kv_blocks=8,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=16,
            warmup=False,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[str(tp)] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "layout": _layout(llm),
        }
        del llm
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
