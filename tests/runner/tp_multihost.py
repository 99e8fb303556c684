"""One process of a two-process tensor-parallel run on 127.0.0.1 (jax.distributed + gloo).

    python tests/runner/tp_multihost.py PROCESS_ID PORT RESULTS.json CHECKPOINT

Each process has 2 simulated CPU devices (XLA_FLAGS set by the caller); jax's distributed
runtime joins them into one 4-device mesh, and both processes run the same engine (tp_cases.py's
llama checkpoint, CHECKPOINT) on the same prompts, as the multi-host recipe says
(jaxserve/runner/sharding.py). The results file gets what this process saw: device counts, the
mesh's processes, the KV pages' sharding and the greedy tokens.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax

NUM_PROCESSES = 2


def main() -> None:
    process_id, port, results_file = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
    checkpoint = sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
        initialization_timeout=60,
    )
    from tp_cases import ENGINE, greedy_params, multihost_prompts  # this script's folder

    from jaxserve import LLM

    llm = LLM(checkpoint, tensor_parallel_size=jax.device_count(), **ENGINE)
    outs = llm.generate(multihost_prompts(), greedy_params(), use_tqdm=False)
    runner = llm.engine.runner
    q_proj = runner.params["layers_0"]["attn"]["q_proj"]
    result = {
        "process_index": jax.process_index(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "mesh_processes": sorted({d.process_index for d in q_proj.sharding.device_set}),
        "q_proj_spec": [a for a in q_proj.sharding.spec],
        "q_proj_local_shard": list(q_proj.addressable_shards[0].data.shape),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    results_file.write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
