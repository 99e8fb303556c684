"""Tensor-parallel MoE run, as a script in a fresh process with 4 simulated CPU devices.

    python tests/models/moe_tp_cases.py CHECKPOINT RESULTS.json

XLA_FLAGS must hold --xla_force_host_platform_device_count=4 before jax starts, hence a
separate process; test_moe.py writes the checkpoint (transformers and torch are imported there,
not here), runs this and checks the JSON it writes: for tp 1, 2 and 4, the greedy tokens of a
tiny Mixtral (4 experts, top-2, expert F = 32) and the spec and device 0's shard shape of layer
0's experts_gate, experts_down and router; and under "int8" the same model quantized to int8 on
load, one prefill's logits at tp 2 against tp 1 and its experts' scales' layout.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoints_tools import load_hf_checkpoint
from jaxserve.models import AttentionMetadata, get_model
from jaxserve.models.causal_lm import TP_AXIS


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


def _quantized_tp(folder: pathlib.Path, seq: list[int]) -> dict[str, object]:
    """The model quantized to int8 on load at tp 1 and 2: one prefill's logits (a forward
    each, no engine: two engine builds would double this script's time), and the layout of
    layer 0's experts' scales at tp 2."""
    one = load_hf_checkpoint(folder, dtype="float32", quantization="int8")
    model = get_model(one.arch, dtype="float32", quantization="int8")
    mesh = Mesh(np.array(jax.devices()[:2]), (TP_AXIS,))
    specs = model.param_partition_specs(2)

    def sharding(path: tuple[str, ...]) -> NamedSharding:
        spec = specs
        for key in path:
            spec = spec[key]
        return NamedSharding(mesh, spec)

    two = load_hf_checkpoint(folder, dtype="float32", quantization="int8", param_sharding=sharding)
    t = len(seq)
    kv = [(jnp.zeros(model.kv_cache_shape(3, 8)),) * 2] * one.arch.num_layers
    positions = jnp.arange(t, dtype=jnp.int32)
    md = AttentionMetadata(
        positions=positions,
        slot_mapping=positions + 8,  # blocks 1 and 2
        block_tables=jnp.asarray([[1, 2]], jnp.int32),
        kv_lens=jnp.asarray([t], jnp.int32),
        cu_q_lens=jnp.asarray([0, t], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )
    step = jax.jit(lambda p: model.compute_logits(p, model.forward(p, kv, jnp.asarray(seq), md)[1]))
    logits = {tp: np.asarray(step(ckpt.params)) for tp, ckpt in ((1, one), (2, two))}
    moe = two.params["layers_0"]["moe"]
    return {
        "max_abs_diff": float(np.abs(logits[1] - logits[2]).max()),
        "max_abs": float(np.abs(logits[1]).max()),
        "same_argmax": bool((logits[1].argmax(-1) == logits[2].argmax(-1)).all()),
        "layout": {
            name: {
                "spec": [None if a is None else str(a) for a in moe[name].sharding.spec],
                "shard_shape": list(moe[name].addressable_shards[0].data.shape),
            }
            for name in ("experts_gate", "experts_gate_scale", "experts_down_scale")
        },
    }


def main(folder: pathlib.Path, out: pathlib.Path) -> None:
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
            max_num_batched_tokens=24,  # the 19 prompt tokens in one step: 2 step shapes
            max_model_len=16,
            warmup=False,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[str(tp)] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "layout": _layout(llm),
        }
        del llm
    results["int8"] = _quantized_tp(folder, prompts[0] + prompts[1])
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
