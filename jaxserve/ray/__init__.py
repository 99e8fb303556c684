"""Batch inference over Ray Data: ``build_processor(...)`` -> a Dataset -> Dataset function that
runs one jaxserve engine (``LLM``) per Ray actor.

::

    from jaxserve.ray import build_processor

    processor = build_processor(
        model="tiny-random-llama",
        engine_kwargs=dict(max_model_len=2048),
        sampling_params=dict(temperature=0.0, max_tokens=64),
        concurrency=2,  # Ray actors, one engine each
        batch_size=32,  # rows per engine call
        resources={"num_gpus": 1},  # per actor: num_cpus / num_gpus / resources
    )
    out = processor(ray.data.from_items([{"id": 0, "prompt": "Hello"}]))

Each input row holds exactly one of ``prompt`` (str), ``messages`` (a chat conversation, a
list of {"role", "content"} rendered with the model's chat template as ``LLM.chat`` does) or
``prompt_token_ids`` (list of int), and may hold a ``sampling_params`` struct column whose
fields override the processor's for that row. A null field of that struct means "not set":
Arrow fills the fields one row lacks with nulls when another row has them. Output rows keep
every input column and add ``generated_text``, ``generated_token_ids``,
``num_generated_tokens``, ``finish_reason``, and ``logprobs`` (the sampled token's logprob at
each generated position, a list of float) when the processor's sampling_params set
``logprobs``. One row in, one row out: ``n > 1`` and ``prompt_logprobs`` are refused.

Ray is imported lazily: this package imports without it, and ``build_processor`` raises an
ImportError naming the ``jaxserve[ray]`` extra when it is missing.
"""

from jaxserve.ray.actor import EngineActor
from jaxserve.ray.checks import OUTPUT_COLUMNS, PARAMS_COLUMN, PROMPT_COLUMNS, RESOURCE_KEYS
from jaxserve.ray.processor import RayProcessor, build_processor

__all__ = [
    "OUTPUT_COLUMNS",
    "PARAMS_COLUMN",
    "PROMPT_COLUMNS",
    "RESOURCE_KEYS",
    "EngineActor",
    "RayProcessor",
    "build_processor",
]
