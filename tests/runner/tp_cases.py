"""Tensor-parallel cases, run as a script in a fresh process with 8 simulated CPU devices.

    python tests/runner/tp_cases.py WORK_DIR RESULTS.json

XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax starts, hence a
separate process; test_tensor_parallel.py runs it once and checks the JSON it writes:

    parity[family][tp]      greedy tokens, param/KV specs and local shard shapes at the family's
                            TP_SIZES (1 and one more; llama's K < tp is maps' tp 8);
                            for llama at tp 1 and 2 also "seeded": seeded sampled tokens; at
                            tp 2 (warmed up) also "compiles": step compilations in warm-up, then
                            step traces and XLA backend compiles while serving
    llama_checkpoint        the llama folder: tp_multihost.py's model (its 4-device mesh over
                            two processes must give parity["llama"][1]'s tokens)
    orbax                   tokens and param shardings of an Orbax checkpoint restored at tp 2
    spec                    llama at tp 2 with speculative decoding, drafts from an oracle that
                            knows tp 1's tokens: greedy and seeded tokens, drafts verified and
                            accepted (k = 3, so several tokens per step); spec["constrained"]:
                            the constrained requests with the real n-gram proposer (drafts
                            checked against a regex and allowed ids); spec["draft_model"]:
                            the same with llama as its own draft model, sharded at tp 2
    maps                    memory maps and executables of llama warmed up at tp 8 with table
                            widths bucketed (runner/map_budget.py), its greedy tokens, param/KV
                            specs and local shard shapes (K = 2 < tp: KV replicated)
    transfer                a JaxTransferConnector producer and consumer at tp 2 each, on
                            disjoint devices (tp_transfer_case.py): the pulled blocks' bits
    kernels[family][backend]  at tp 2 under shard_map, each per-device attention for llama (xla,
                            cpu, pallas in interpret mode), the Pallas kernel for qwen3;
                            kernels[family]["hf"]: transformers' greedy tokens and top-2 margins
"""

from __future__ import annotations

import json
import pathlib
import random
import sys
from typing import Any

import jax
from tp_transfer_case import run_transfer

from jaxserve import LLM, LLMEngine, SamplingParams
from jaxserve.checkpoints_tools.convert import convert_hf_to_orbax
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint
from jaxserve.runner.sharding import plan_sharding

# N = 8 query heads everywhere; K from 1 (MQA) to 8, so K < tp, K == tp and K > tp all occur.
# mistral's vocabulary (515) is divisible by no tp > 1: embed and lm_head are replicated.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=1, vocab_size=515, sliding_window=6),
    "qwen2": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=8),
}
# llama at tp 1 and 2 (K == tp; its K < tp is run_maps' warmed-up engine at tp 8, tokens and
# layout); one more for each other family, the case its K or vocabulary adds (each engine
# costs a few seconds of compiling on 8 CPU devices): mistral K < tp with a replicated
# vocabulary, qwen2 K == tp with tied embeddings, qwen3 K > tp.
TP_SIZES = {"llama": (1, 2), "mistral": (1, 2), "qwen2": (1, 4), "qwen3": (1, 4)}
COMMON = dict(num_attention_heads=8, head_dim=16)
# run_kernels' per-device attentions under shard_map at tp 2.
KERNEL_CASES = {"llama": ("xla", "cpu", "pallas"), "qwen3": ("pallas",)}
ENGINE = dict(
    dtype="float32",
    # One page per sequence: one table width, so each engine compiles its step once per token
    # bucket, or twice (greedy and sampled); the 18 prompt tokens of a batch still take two
    # steps (chunked: PROMPT_LENS).
    block_size=16,
    num_kv_blocks=8,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=16,
    warmup=False,
)


# A batch's prompts take two steps at 16 tokens a step: 16 tokens (the last prompt chunked),
# then its last 2 beside 2 decodes, so every later step decodes 3 rows (token bucket 4). That
# prompt starts decoding a step after the others: with one token fewer it ends with them, and
# no 1-row tail step compiles buckets of its own (an engine's greedy run compiles 4 step
# executables instead of 8: 16 and 4 tokens, each forward and sample).
PROMPT_LENS = (9, 3, 6)
MAX_TOKENS = (6, 6, 5)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def greedy_params() -> list[SamplingParams]:
    """One per prompt of _prompts (MAX_TOKENS)."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def _spec(x: jax.Array) -> list[Any]:
    return [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]


def _layout(llm: LLM) -> dict[str, Any]:
    """Specs and the shape of device 0's shard of a few params and of the KV pages."""
    runner = llm.engine.runner
    attn = runner.params["layers_0"]["attn"]
    arrays = {
        "q_proj": attn["q_proj"],
        "k_proj": attn["k_proj"],
        "down_proj": runner.params["layers_0"]["mlp"]["down_proj"],
        "embed": runner.params["embed"],
        "kv_pages": runner.kv_caches[0][0],
    }
    return {
        name: {
            "spec": _spec(x),
            "shard_shape": list(x.addressable_shards[0].data.shape),
            "num_devices": len(x.sharding.device_set),
        }
        for name, x in arrays.items()
    }


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, greedy_params(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _seeded(llm: LLM) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=8, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=9, max_tokens=5, ignore_eos=True),
    ]  # MAX_TOKENS
    outs = llm.generate(_prompts(512, seed=1), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


CONSTRAINED_REGEX = "[ab]{2,5}"
REPEAT_REGEX = "(a b ){4}"  # its prompt already says "a b a b": n-gram drafts from the start


def _constrained(llm: LLM) -> dict[str, Any]:
    """Structured outputs and token constraints: two regexes, and a logit bias with a ban
    list, each greedy (the mask and the bias are applied to the vocabulary-sharded logits)."""
    prompt = [5, 17, 42]
    repeat = [5, *llm.get_tokenizer().encode("a b a b", add_special_tokens=False).ids]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6,
                       structured_outputs={"regex": CONSTRAINED_REGEX}),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                       logit_bias={7: 100.0}, allowed_token_ids=list(range(3, 40))),
        SamplingParams(temperature=0.0, max_tokens=10,
                       structured_outputs={"regex": REPEAT_REGEX}),
    ]  # fmt: skip
    outs = llm.generate([prompt, prompt, repeat], params, use_tqdm=False)
    return {"regex": CONSTRAINED_REGEX, "regex_text": outs[0].outputs[0].text,
            "biased": outs[1].outputs[0].token_ids,
            "repeat_text": outs[2].outputs[0].text,
            "repeat": outs[2].outputs[0].token_ids}  # fmt: skip


class _BackendCompiles:
    """Counts XLA backend compiles (any function) while `on`."""

    def __init__(self) -> None:
        self.on, self.count = False, 0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, secs: float, **kwargs: Any) -> None:
        if self.on and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def _serve_stream(engine: LLMEngine) -> None:
    """A stream of greedy and seeded sampled requests, arriving while others run."""
    rng = random.Random(0)
    for i, prompt in enumerate(_prompts(512, seed=2) * 2):
        temperature = rng.choice([0.0, 0.8])
        params = SamplingParams(temperature=temperature, max_tokens=rng.randrange(1, 8), seed=i)
        engine.add_request(f"stream-{i}", prompt, params)
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def run_parity(work: pathlib.Path) -> dict[str, Any]:
    """Every family at its TP_SIZES. The llama engines also sample seeded requests (tp 1, 2); the
    llama tp 2 engine is warmed up, and everything it serves is counted for compilations."""
    compiles = _BackendCompiles()
    results: dict[str, Any] = {}
    for family, overrides in FAMILIES.items():
        folder = write_tiny_hf_checkpoint(work / family, family, **COMMON, **overrides)
        prompts = _prompts(overrides.get("vocab_size", 512))
        results[family] = {}
        for tp in TP_SIZES[family]:
            warm = family == "llama" and tp == 2
            llm = LLM(str(folder), tensor_parallel_size=tp, **{**ENGINE, "warmup": warm})
            compiles.on = warm
            warmup_compilations = llm.get_stats()["num_compilations"]
            case = {
                "tokens": _greedy(llm, prompts),
                "layout": _layout(llm),
                "attention": llm.get_stats()["plan"]["attention"],
            }
            if family == "llama" and tp <= 2:
                case["seeded"] = _seeded(llm)
                case["constrained"] = _constrained(llm)  # tp 2: counted after warm-up
            if warm:
                _serve_stream(llm.engine)
                case["compiles"] = {
                    "warmup": warmup_compilations,
                    "after": llm.get_stats()["num_compilations"],
                    "backend_compiles_after_warmup": compiles.count,
                    "num_steps": llm.get_stats()["num_steps"],
                }
                compiles.on = False
            results[family][tp] = case
    return results


def _hf_greedy(folder: pathlib.Path, prompts: list[list[int]]) -> list[dict[str, list]]:
    """transformers' greedy tokens (MAX_TOKENS) with the top-2 logit margin at each step."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for prompt, max_tokens in zip(prompts, MAX_TOKENS, strict=True):
            ids, tokens, margins = list(prompt), [], []
            for _ in range(max_tokens):
                top2 = torch.topk(model(torch.tensor([ids])).logits[0, -1], 2)
                tokens.append(int(top2.indices[0]))
                margins.append(float(top2.values[0] - top2.values[1]))
                ids.append(tokens[-1])
            out.append({"tokens": tokens, "margins": margins})
    return out


class _Oracle:
    """Always-right drafts: each prompt's reference tokens (from the tp 1 run)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference

    def propose(self, requests, k):
        out = {}
        for req in requests:
            full = list(req.prompt_token_ids) + self.reference[tuple(req.prompt_token_ids)]
            out[req.request_id] = full[len(req.all_token_ids) : len(req.all_token_ids) + k]
        return out


def run_spec(work: pathlib.Path, parity: dict[str, Any]) -> dict[str, Any]:
    """llama at tp 2 verifying drafts: the tokens must be tp 1's, greedy and seeded."""
    from jaxserve.spec_decode import SpecDecoder
    from jaxserve.speculative_config import SpeculativeConfig

    config = {"method": "ngram", "num_speculative_tokens": 3, "policy": "always"}
    llm = LLM(str(work / "llama"), tensor_parallel_size=2, speculative_config=config, **ENGINE)
    greedy_prompts, seeded_prompts = _prompts(512), _prompts(512, seed=1)
    reference = dict(zip(map(tuple, greedy_prompts), parity["llama"][1]["tokens"], strict=True))
    reference.update(zip(map(tuple, seeded_prompts), parity["llama"][1]["seeded"], strict=True))
    llm.engine.core.spec = SpecDecoder(SpeculativeConfig(**config), proposer=_Oracle(reference))
    out = {"tokens": _greedy(llm, greedy_prompts), "seeded": _seeded(llm)}
    stats = llm.get_stats()
    out["draft_tokens"] = stats["spec_decode_num_draft_tokens"]
    out["accepted_tokens"] = stats["spec_decode_num_accepted_tokens"]
    # The real n-gram proposer under constraints: drafts from repeats, checked against the
    # grammar, the allowed ids and the bias's forced token; the tokens must still be tp 1's.
    llm.engine.core.spec = SpecDecoder(SpeculativeConfig(**config))
    out["constrained"] = _constrained(llm)
    out["constrained_draft_tokens"] = (
        llm.get_stats()["spec_decode_num_draft_tokens"] - out["draft_tokens"]
    )
    del llm
    # The draft-model form: the target as its own draft, sharded like it on the same mesh.
    config = {**config, "method": "draft_model", "model": str(work / "llama")}
    llm = LLM(str(work / "llama"), tensor_parallel_size=2, speculative_config=config, **ENGINE)
    draft = {"tokens": _greedy(llm, greedy_prompts)}
    stats = llm.get_stats()  # greedy drafts of the target itself, verified greedily
    draft["draft_tokens"] = stats["spec_decode_num_draft_tokens"]
    draft["accepted_tokens"] = stats["spec_decode_num_accepted_tokens"]
    draft["seeded"] = _seeded(llm)
    # Unseeded random requests: drafts sampled by the sharded draft, verified by the general rule.
    unseeded = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    before = llm.get_stats()["spec_decode_num_draft_tokens"]
    outs = llm.generate(greedy_prompts, unseeded, use_tqdm=False)
    draft["unseeded_lengths"] = [len(o.outputs[0].token_ids) for o in outs]
    draft["sampled_draft_tokens"] = llm.get_stats()["spec_decode_num_draft_tokens"] - before
    draft["kv_spec"] = _spec(llm.engine.runner.draft.kv_caches[0][0])
    draft["q_proj_spec"] = _spec(llm.engine.runner.draft.params["layers_0"]["attn"]["q_proj"])
    out["draft_model"] = draft
    del llm
    # A draft with one KV head (MQA) at tp 2, under an attention kernel that runs per device:
    # tp splits its query heads but not its KV heads, which the kernel cannot take. Refused
    # before any weight loads, naming the draft.
    mqa = write_tiny_hf_checkpoint(
        work / "mqa-draft", "llama", **{**COMMON, "num_key_value_heads": 1}
    )
    config = {**config, "model": str(mqa)}
    try:
        LLM(str(work / "llama"), tensor_parallel_size=2, speculative_config=config,
            attention_backend="cpu", **ENGINE)  # fmt: skip
        out["mqa_draft_refusal"] = None
    except ValueError as e:
        out["mqa_draft_refusal"] = str(e)
    return out


def run_kernels(work: pathlib.Path) -> dict[str, Any]:
    """The per-device implementations under shard_map at tp 2, beside transformers' greedy
    tokens: llama (K = 2: one KV head per device) with xla, the C++ cpu kernel and the Pallas
    (Triton) kernel in interpret mode; qwen3 (K = 8: four per device) with the Pallas kernel
    (its cpu kernel per device is the parity run's at tp 4)."""
    results: dict[str, Any] = {}
    for family, backends in KERNEL_CASES.items():
        folder = work / family  # written by run_parity
        prompts = _prompts(512)
        results[family] = {"hf": _hf_greedy(folder, prompts)}
        for backend in backends:
            llm = LLM(str(folder), tensor_parallel_size=2, attention_backend=backend, **ENGINE)
            plan = llm.get_stats()["plan"]
            results[family][backend] = {
                "tokens": _greedy(llm, prompts),
                "attention": plan["attention"],
                "interpret": plan["attention_interpret"],
                "sharded": llm.engine.runner.model.attention.mesh is not None,
            }
    return results


def multihost_prompts() -> list[list[int]]:
    """The prompts of tp_multihost.py: parity["llama"]'s, so its tp 1 tokens are the reference
    that the two processes (2 devices each, one 4-device mesh) must reproduce."""
    return _prompts(512)


def run_orbax(work: pathlib.Path) -> dict[str, Any]:
    orbax_dir = convert_hf_to_orbax(work / "llama", work / "llama_orbax")
    prompts = _prompts(512)
    llm = LLM(str(orbax_dir), tensor_parallel_size=2, **ENGINE)
    runner = llm.engine.runner
    plan = plan_sharding(runner.model, runner.params["embed"].sharding.mesh)
    same = jax.tree_util.tree_map(
        lambda x, want: x.sharding.is_equivalent_to(want, x.ndim),
        runner.params,
        plan.param_shardings(),
    )
    return {
        "tokens": _greedy(llm, prompts),
        "layout": _layout(llm),
        "shardings_as_planned": all(jax.tree_util.tree_leaves(same)),
    }


def run_fp8_calibration(work: pathlib.Path) -> dict[int, list[list[float]]]:
    """An FP8 KV cache's scales computed by the calibration pass (runner/kv_calibration.py,
    the default when a checkpoint ships none) at tp 1 and 2: the pass runs partitioned by
    GSPMD under tp and must find the same per-layer maxima (engines without warm-up: the
    pass is all that compiles)."""
    out = {}
    for tp in (1, 2):
        llm = LLM(str(work / "llama"), tensor_parallel_size=tp, kv_cache_dtype="fp8", **ENGINE)
        out[tp] = llm.engine.runner.kv_scales.tolist()
        del llm
    return out


# Warm-up at tp 8 with table widths to bucket: llama's 2 KV heads do not split 8 ways,
# so the reference attention runs, the step's forward half per token bucket x width (2 x 3), its
# sample half per row bucket x sampler variant (2 x 2), and 3 copies: 13 executables (~2 s each
# to compile on 8 devices), each holding its memory maps (test_buckets.py checks how the map
# budget thins the widths when there would be too many).
MAPS_ENGINE = {
    **ENGINE,
    "block_size": 8,
    "num_kv_blocks": 16,
    "max_model_len": 32,
    "max_num_batched_tokens": 4,
    "warmup": True,
}


def run_maps(work: pathlib.Path) -> dict[str, Any]:
    """Memory maps, executables, greedy tokens and layout of a warmed-up engine at tp 8 (issue
    29, item 18: tp 4 with warm-up died of too many maps; tp 8 holds more)."""
    before = _num_maps()
    llm = LLM(str(work / "llama"), tensor_parallel_size=8, **MAPS_ENGINE)
    stats = llm.get_stats()
    return {
        "maps_added": _num_maps() - before,
        "executables": stats["num_compilations"] + stats["num_compilation_cache_hits"],
        "max_executables": stats["plan"]["max_executables"],
        "attention": stats["plan"]["attention"],
        "width_buckets": list(llm.engine.runner.buckets.width_buckets),
        "tokens": _greedy(llm, _prompts(512)),
        "layout": _layout(llm),
    }


def _num_maps() -> int:
    return len(pathlib.Path("/proc/self/maps").read_text().splitlines())


def main() -> None:
    work, results_file = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    assert jax.device_count() == 8, jax.devices()
    parity = run_parity(work)
    results = {
        "parity": parity,
        "spec": run_spec(work, parity),
        "kernels": run_kernels(work),
        "llama_checkpoint": str(work / "llama"),
        "orbax": run_orbax(work),
        "fp8_calibration": run_fp8_calibration(work),
        "maps": run_maps(work),
        "transfer": run_transfer(),
    }
    results_file.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
