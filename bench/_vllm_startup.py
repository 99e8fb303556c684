"""vLLM's side of bench/startup.py's experiment 5: spawn -> LLM(...) -> the first token.

Runs under an interpreter with vLLM installed (a venv with vLLM's CPU build, made by hand) and
never imports jaxserve:

    PYTHON bench/_vllm_startup.py SPEC_JSON SPAWN

SPEC_JSON: {"llm": the keyword arguments of vllm.LLM (model included), "prompt": token ids}.
SPAWN: the parent's time.time() just before it spawned this process. One LLM(**llm), then one
generate() of the prompt with max_tokens=1, greedy. Prints one line, ``RESULT {json}``:
imported / built / first_token (time.time() stamps), the token ids, vLLM's and torch's versions.
The compilation cache is vLLM's own (VLLM_CACHE_ROOT, set by the parent).
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_json: str, spawn: float) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    imported = time.time()
    spec = json.loads(spec_json)
    llm = LLM(**spec["llm"])
    built = time.time()
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"])], params, use_tqdm=False)
    done = time.time()
    return {
        "spawn": spawn,
        "imported": imported,
        "built": built,
        "first_token": done,
        "token_ids": list(outs[0].outputs[0].token_ids),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
    }


if __name__ == "__main__":  # vLLM starts its engine-core and worker processes: guard required
    result = main(sys.argv[1], float(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
